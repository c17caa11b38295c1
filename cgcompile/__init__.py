"""cgcompile: a torch.compile backend that captures module-tagged partitions in CUDA graphs.

Public API only (the docs site, docs/ and `make docs`, documents it). The backend itself is registered as
"cudagraph_modules" through the `torch_dynamo_backends` entry point, so `torch.compile(m,
backend="cudagraph_modules")` needs no import.
"""

from .config import CudaGraphConfig, CudaGraphImpl, CudaGraphModule, CudaGraphScope, InferenceCudaGraphScope
from .errors import ConfigError
from .explain import Plan, explain
from .hf import HF_FAMILIES, tag_hf
from .megatron_tags import MEGATRON_ROLES, tag_megatron
from .runtime.release import release
from .runtime.frame.whole_step import capture_step
from .scope import transition_cudagraph_scope
from .tagging import eager_region, tag, tag_modules, tag_of, untag
from .report import report
from .stats import reset_stats, stats

__all__ = [
    "ConfigError", "CudaGraphConfig", "HF_FAMILIES", "MEGATRON_ROLES", "Plan", "explain", "CudaGraphImpl",
    "CudaGraphModule", "CudaGraphScope",
    "InferenceCudaGraphScope", "capture_step", "eager_region", "release", "report", "reset_stats", "stats", "tag",
    "tag_hf", "tag_megatron", "tag_modules", "tag_of", "transition_cudagraph_scope", "untag",
]

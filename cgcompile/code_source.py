"""Where an op's code comes from (transformers, torchtitan, Megatron-Core or the user's own), and the hints that fit
there: a fix names the knob that exists in that code (transformers' `experts_implementation`, Megatron-Core's
TransformerConfig, torchtitan's MoE args), and the user's own code gets the edit to make. Read from the source
file's path (a frame of the user's stack) or a module class's `__module__`; nothing here imports those projects.
"""

from __future__ import annotations

import os
from typing import Optional

from .config_values import ChoiceEnum

__all__ = ["CodeSource", "data_dependent_break_hint", "host_read_hint", "source_of"]


class CodeSource(ChoiceEnum):
    TRANSFORMERS = "transformers"
    TORCHTITAN = "torchtitan"
    MEGATRON_CORE = "megatron_core"
    USER = "user"


# the top-level package each library's modules live in
_PACKAGES = {"transformers": CodeSource.TRANSFORMERS, "torchtitan": CodeSource.TORCHTITAN,
             "megatron": CodeSource.MEGATRON_CORE}


def source_of(path: Optional[str] = None, module: Optional[str] = None) -> CodeSource:
    """The library a source file (`.../site-packages/megatron/core/...py`, a torchtitan checkout) or a dotted
    module name (a module class's `__module__`) belongs to; the user's own code otherwise."""
    if path:  # the file the op is written in: the code to edit, whichever module runs it
        parts = os.path.normpath(os.path.abspath(path)).split(os.sep)[:-1]
        return next((_PACKAGES[part] for part in reversed(parts) if part in _PACKAGES), CodeSource.USER)
    return _PACKAGES.get((module or "").split(".")[0], CodeSource.USER)


_DATA_DEPENDENT_BREAK = {
    CodeSource.USER: (
        "the code after this data-dependent size runs in Python, so dynamic_padding cannot pad it: loop over a "
        "fixed range (`for e in range(num_experts): idx, top = torch.where(mask[e])`) with "
        "torch._dynamo.config.capture_dynamic_output_shape_ops=True and dynamic_padding='max' or 'buckets'"),
    CodeSource.TRANSFORMERS: (
        "transformers 5's eager experts loop (`for expert_idx in expert_hit`) runs in Python after this "
        "data-dependent size, so dynamic_padding cannot pad it: use experts_implementation='grouped_mm' (the default), "
        "which traces without a break"),
    CodeSource.MEGATRON_CORE: (
        "Megatron-Core's token dispatcher sizes its buffers by the routing (tokens per expert, read on the host): "
        "leave the dispatch eager as Megatron's partial CUDA graphs do (cgcompile.tag_megatron(model), "
        "cuda_graph_modules=['attn', 'moe_router']), or make its shapes static with TransformerConfig("
        "moe_expert_capacity_factor=..., moe_pad_expert_input_to_capacity=True)"),
    CodeSource.TORCHTITAN: (
        "torchtitan's MoE reads tokens per expert on the host here (the for-loop experts, or expert parallel's "
        "all-to-all split sizes): keep MoEArgs(use_grouped_mm=True) (the default) and leave the token dispatch "
        "eager (tag and select attention and the router only)"),
}

_HOST_READ = {
    CodeSource.TRANSFORMERS: (
        "inside transformers' modeling code: it runs eagerly, the rest is captured around it; to capture no island, "
        "leave this module out of cuda_graph_modules (for MoE experts: experts_implementation='grouped_mm' with "
        "bfloat16 weights reads nothing on the host)"),
    CodeSource.MEGATRON_CORE: (
        "inside Megatron-Core: it runs eagerly, the rest is captured around it; to capture what Megatron's "
        "--cuda-graph-scope does, cgcompile.tag_megatron(model) and cuda_graph_modules=['attn', 'moe_router'] "
        "(in the MoE token dispatcher, TransformerConfig(moe_expert_capacity_factor=..., "
        "moe_pad_expert_input_to_capacity=True) makes its shapes static)"),
    CodeSource.TORCHTITAN: (
        "inside torchtitan: it runs eagerly, the rest is captured around it; in MoE keep MoEArgs(use_grouped_mm=True) "
        "(the default; the for-loop experts read tokens per expert on the host) and leave the token dispatch out "
        "of the captured regions"),
}


def data_dependent_break_hint(source: CodeSource) -> str:
    """The fix for a Dynamo graph break at a data-dependent size in code from `source`."""
    return _DATA_DEPENDENT_BREAK[source]


def host_read_hint(source: CodeSource, generic: Optional[str]) -> Optional[str]:
    """A host read's fix: the generic edit in the user's own code; in a library's code, which the user does not
    edit, that library's knob."""
    return _HOST_READ.get(source, generic)

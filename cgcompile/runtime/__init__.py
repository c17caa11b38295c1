"""Runtimes that execute captured partitions: drivers (capture/replay) and the local fwd/bwd graph runtime.

Introspection (read-only, for tests and tools): `live_runtimes()` lists the ModelRuntimes alive now;
`ModelRuntime.live_graphs()` its captured graphs (GraphInstance: `partition`, `kind`, `captured.static_inputs`,
`copied_inputs`, `replays`), `ModelRuntime.runners()` its PartitionRunners (`name`, `bank_size()`).
"""

from .drivers.base import CaptureError, CapturedGraph, Driver, StaleReplayError, is_capturing
from .drivers.select import get_driver
from .local.instance import GraphInstance
from .local.model_runtime import ModelRuntime, live_runtimes
from .local.compile import compile_partition
from .local.runner import PartitionRunner

__all__ = ["CaptureError", "CapturedGraph", "Driver", "StaleReplayError", "GraphInstance", "ModelRuntime", "PartitionRunner",
           "compile_partition", "get_driver", "is_capturing", "live_runtimes"]

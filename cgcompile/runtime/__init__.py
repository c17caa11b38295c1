"""Runtimes that execute captured partitions: drivers (capture/replay) and the local fwd/bwd graph runtime."""

from .driver import CaptureError, CapturedGraph, Driver, get_driver, is_capturing
from .local import ModelRuntime, compile_partition

__all__ = ["CaptureError", "CapturedGraph", "Driver", "ModelRuntime", "compile_partition", "get_driver",
           "is_capturing"]

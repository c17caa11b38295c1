"""Choosing a driver: `get_driver` for option `driver`, and the eager driver (no capture at all)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .cuda_driver import CudaDriver
from .driver import CapturedGraph, Driver, Fn
from .emulate_driver import EmulateDriver

__all__ = ["EagerDriver", "get_driver"]


class EagerDriver(Driver):
    """No capture: the runtime sees `captures` False and runs partitions as they are (capture off or impossible)."""

    name = "eager"
    captures = False

    def capture(self, fn: Fn, static_inputs: Sequence[Any], pool: Any = None, *,
                warmup: bool = True, written: Sequence[int] = ()) -> CapturedGraph:
        raise TypeError("the eager driver captures nothing: check Driver.captures first")


def get_driver(name: str, device: Any) -> Driver:
    """The driver for option `driver` (auto | cuda | emulate | eager) on `device`.

    auto = cuda when the device is a CUDA device, else eager.
    """
    name = str(name)
    device = torch.device(device)
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "eager"
    if name == "cuda":
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"driver='cuda' needs a CUDA device, got {device}; use driver='emulate' on CPU")
        return CudaDriver(device)
    if name == "emulate":
        return EmulateDriver()
    if name == "eager":
        return EagerDriver()
    raise ValueError(f"unknown driver {name!r}: expected auto, cuda, emulate or eager")

"""Choosing a driver: `get_driver` for option `driver`, which partitions of a frame the device's driver can capture
(`captures_on`; the frame's device is cgcompile/devices.py's `device_of`), and the eager driver (no capture)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .cuda import CudaDriver
from .base import Driver
from .emulate import EmulateDriver

__all__ = ["EagerDriver", "captures_on", "get_driver"]


class EagerDriver(Driver):
    """No capture: the runtime sees `captures` False and runs partitions as they are (capture off or impossible)."""

    name = "eager"
    captures = False


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


def captures_on(device: torch.device, values: Sequence[Any]) -> bool:
    """Can a CUDA capture on `device` record a partition with these inputs? Only if it has CUDA tensors and all
    are on `device`: a capture records the capturing stream of its own device, and kernels on another device's
    tensors run on that device's stream, uncaptured (at replay they would not run at all)."""
    devices = {t.device for t in values if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
    return devices == {device}

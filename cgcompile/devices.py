"""The device a compiled frame runs on, read from its example inputs: shared by planning and the runtime."""

from __future__ import annotations

import collections
from typing import Any, Sequence

import torch

__all__ = ["device_of"]


def device_of(values: Sequence[Any]) -> torch.device:
    """The device a frame runs on, with its index: the accelerator device holding most of its tensor inputs (the
    parameters decide), the first of those on a tie; cpu when none is on an accelerator.

    The index matters: a model on cuda:1 while the current device is 0 (torchrun without set_device,
    `model.to("cuda:1")`, a device_map) must get its streams, pools and captures on cuda:1.
    """
    counts = collections.Counter(t.device for t in values if isinstance(t, torch.Tensor) and t.device.type != "cpu")
    return max(counts, key=counts.__getitem__) if counts else torch.device("cpu")

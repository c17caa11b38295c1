"""Wrapper tensor subclasses (DTensor, torchao's float8 / NF4 tensors) seen through to the plain tensors that hold
their data.

A DTensor parameter has no memory of its own: its data is its local shard, an ordinary tensor. aot_autograd
flattens such wrappers into their inner tensors before the graphs we capture run (and wraps the graphs' outputs
again), so graph inputs, parameter addresses and the memory registry are all plain tensors already. What still
holds the wrappers is the partition's view of a call, its arguments as Dynamo passes them (which storages are
parameters), and the frame's outputs (whether one lives in graph memory). Those go through here. The graph-bank
key reads a wrapper argument's own metadata (its global shape, dtype): its placements and mesh are fixed by the
graph itself and by Dynamo's guards on the frame's inputs.
"""

from __future__ import annotations

from typing import List

import torch

from .. import _compat

__all__ = ["inner_tensors"]


def inner_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    """The plain tensors holding t's data, in aot_autograd's flattening order: [t] for a plain tensor; for a wrapper
    subclass, the tensor attributes `__tensor_flatten__` names, recursively (a DTensor: its local shard)."""
    if not _compat.is_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    attributes = [getattr(t, name) for name in names]  # DTensor's include its device mesh, which holds no data
    return [inner for value in attributes if isinstance(value, torch.Tensor) for inner in inner_tensors(value)]


"""How a call of a captured partition is keyed: its graph-bank key and its parameter set.

The bank key tells input signatures apart (grad, inference and autocast modes, and per argument the bank reads its
metadata or value); the parameter set tells apart the layers one compiled frame serves (Dynamo reuses a frame for
every layer of a model that graph-breaks inside its layers): the identity of the partition's first parameter
object, so a parameter that moves (`p.data = ...`) stays in its set.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from ... import _compat
from ..tensors import is_param_or_buffer

__all__ = ["BankKey"]


class BankKey:
    """The argument positions a partition's keys read, learnt from its first call (`learn`)."""

    def __init__(self, static_indices: frozenset, static_shapes: bool):
        self.static_indices = static_indices  # parameters and buffers Dynamo marked static
        self.static_shapes = static_shapes  # traced by Dynamo with concrete sizes: its guards fix input metadata
        self.set_index: Optional[int] = None  # the position of the first parameter: its identity is the set's
        self.dynamic: Optional[List[int]] = None  # argument positions the bank key reads (None: not learnt yet)

    def learn(self, args: Sequence[Any]) -> None:
        static = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and (
            i in self.static_indices or is_param_or_buffer(a))]
        parameters = [i for i in static if isinstance(args[i], torch.nn.Parameter)]
        self.set_index = (parameters or static or [None])[0]
        dynamic = [i for i in range(len(args)) if i not in self.static_indices]
        # Traced by Dynamo without a symbolic size, the frame's guards fix every tensor input's metadata (as
        # torch.compile's own compiled graphs trust them): only the values of non-tensor inputs can vary.
        self.dynamic = dynamic if not self.static_shapes else [
            i for i in dynamic if not isinstance(args[i], torch.Tensor)]

    def param_set(self, args: Sequence[Any]) -> int:
        """The parameter set of a call: the identity of its first parameter (0 for a partition without one)."""
        return id(args[self.set_index]) if self.set_index is not None else 0

    def of(self, args: Sequence[Any]) -> tuple:
        """Graph-bank key: grad/inference/autocast mode, and per argument its metadata or value.

        Parameters and buffers (the static indices) are left out: Dynamo's guards on the frame already fix
        their shape, stride, dtype, device and requires_grad, and a decode step's partition takes a hundred of
        them, so keying them would cost more host time per call than the rest of the replay path. In a frame
        traced without symbolic sizes the same holds for every tensor input (learn)."""
        if _compat.any_autocast():
            modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cuda"),
                     torch.is_autocast_enabled("cpu"), len(args))
        else:
            modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), False, False, len(args))
        if not self.dynamic:
            return modes
        key: List[Any] = list(modes)
        for index in self.dynamic:
            arg = args[index]
            if isinstance(arg, torch.Tensor):
                key.append((arg.shape, arg.stride(), arg.dtype, arg.device, arg.requires_grad))
            else:
                try:
                    hash(arg)
                    key.append((type(arg), arg))
                except TypeError:
                    key.append((type(arg), id(arg)))
        return tuple(key)

"""How a call of a captured partition is keyed: its graph-bank key and its parameter set.

The bank key (`BankKey`) tells input signatures apart (grad, inference and autocast modes, and per argument the
bank reads its metadata or value); the parameter set (`ParamSetIdentity`) tells apart the layers one compiled frame
serves (Dynamo reuses a frame for every layer of a model that graph-breaks inside its layers).

A parameter set's identity must be stable by construction, the same object on every call of one layer and on every
rank: a per-call identity starts a new set (and its warmup) on every call, so the partition never captures. It is
the first argument that is a parameter object a module registers (`registered_parameter`; a parameter that moves,
`p.data = ...`, stays in its set); a tensor that only passes `isinstance(x, nn.Parameter)`
(one flagged `_is_param`, as DTensor's `to_local()` of an FSDP2 parameter is, a fresh object on every call) is not
one. Without such a parameter, the first other static input (a buffer Dynamo marked static) is; with only such
flagged tensors, the storage of the first: the storage a fresh view of a parameter shares with it.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch

from ... import _compat
from ..tensors import flagged_parameter, is_param_or_buffer, registered_parameter

__all__ = ["MODE_FIELDS", "BankKey", "ParamSetIdentity"]

MODE_FIELDS = 5  # a bank key starts with the grad, inference, cuda and cpu autocast modes and the argument count


class BankKey:
    """The argument positions a partition's keys read, learnt from its first call (`learn`)."""

    def __init__(self, static_indices: frozenset, static_shapes: bool):
        self.static_indices = static_indices  # parameters and buffers Dynamo marked static
        self.static_shapes = static_shapes  # traced by Dynamo with concrete sizes: its guards fix input metadata
        self.dynamic: Optional[List[int]] = None  # argument positions the bank key reads (None: not learnt yet)

    def learn(self, args: Sequence[Any]) -> None:
        dynamic = [i for i in range(len(args)) if i not in self.static_indices]
        # Traced by Dynamo without a symbolic size, the frame's guards fix every tensor input's metadata (as
        # torch.compile's own compiled graphs trust them): only the values of non-tensor inputs can vary.
        self.dynamic = dynamic if not self.static_shapes else [
            i for i in dynamic if not isinstance(args[i], torch.Tensor)]

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


class ParamSetIdentity:
    """Which argument identifies a call's parameter set, and how (learnt from the first call, `learn`)."""

    def __init__(self, static_indices: frozenset):
        self.static_indices = static_indices
        self.index: Optional[int] = None  # the argument whose identity is the set's (None: the partition has one set)
        self.by_object = True  # its object identity (a parameter by type); else its storage's
        self._alive: Dict[int, Any] = {}  # per set seen, a weak reference to its identity (object or storage)

    def learn(self, args: Sequence[Any]) -> None:
        static = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and (
            i in self.static_indices or is_param_or_buffer(a))]
        parameters = [i for i in static if registered_parameter(args[i])]
        pretenders = [i for i in static if flagged_parameter(args[i])]
        others = [i for i in static if i not in pretenders]  # buffers and other tensors Dynamo marked static
        self.by_object = bool(parameters or others) or not pretenders
        self.index = (parameters or others or pretenders or [None])[0]

    def of(self, args: Sequence[Any]) -> int:
        """The parameter set of a call (0 for a partition without parameters)."""
        index = self.index
        if index is None:
            return 0
        if self.by_object:
            return id(args[index])
        return _compat.storage_key(args[index])[1] or id(args[index])


    def arrived(self, param_set: int) -> bool:
        """Is this call's set new: never seen, or its identity died (and the number came back with a new one)?
        The caller asks gone() next, then watch()es it."""
        if self.index is None:
            return False
        watched = self._alive.get(param_set)
        return watched is None or _expired(watched)

    def watch(self, args: Sequence[Any], param_set: int) -> None:
        """Watch a new set's identity from now on (gone() tells when it dies)."""
        arg = args[self.index]
        self._alive[param_set] = weakref.ref(arg) if self.by_object else _compat.storage_weak_ref(arg)

    def gone(self) -> List[int]:
        """The sets whose identity died since last asked: gone for good (a per-call identity dies after its call)."""
        dead = [param_set for param_set, watched in self._alive.items() if _expired(watched)]
        for param_set in dead:
            del self._alive[param_set]
        return dead

    def describe(self, args: Sequence[Any]) -> str:
        """Which argument the identity is, for messages."""
        return f"argument {self.index} ({type(args[self.index]).__name__})" if self.index is not None else "none"


def _expired(watched: Any) -> bool:
    return watched() is None if isinstance(watched, weakref.ref) else watched.expired()

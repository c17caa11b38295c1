"""Undo the writes of a run that stands for no real execution: an emulated capture (a real capture records kernels
and runs none), the CUDA driver's warmup before a capture, an eager probe of a graph's output layouts.

Parameters, optimizer state, KV caches and other inputs must come out of such a run as they went in, or the replay
that follows would apply the writes a second time. Only the storages written are saved, each once, before its
first write (per the ops' schemas), so a run that writes nothing costs nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ... import _compat
from ...passes.common import schema_writes

__all__ = ["WriteUndo"]


class WriteUndo(_compat.TorchDispatchMode):
    """`with WriteUndo() as undo: run()` then `undo.restore()`: every storage the run wrote is as before."""

    supports_higher_order_operators = True  # their bodies are functional here (activation checkpointing's rng ops)

    def __init__(self, written: Sequence[Any] = ()) -> None:
        """`written`: tensors the run writes where no op announces it (a compiled kernel): saved up front."""
        super().__init__()
        self.saved: dict = {}
        for value in written:
            self._save(value)

    def _save(self, value: torch.Tensor) -> None:
        storage = value.untyped_storage()
        if storage.data_ptr() not in self.saved and storage.nbytes():
            self.saved[storage.data_ptr()] = (storage, storage.clone())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)  # higher-order operators have none
        for value in schema_writes(schema, args, kwargs) if schema is not None else ():
            if isinstance(value, torch.Tensor):
                self._save(value)
        return func(*args, **kwargs)

    def restore(self) -> None:
        for storage, before in self.saved.values():
            storage.copy_(before)
        self.saved.clear()

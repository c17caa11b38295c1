"""The capture guard: fail at the first host sync of code about to be captured, before it runs.

A real CUDA capture rejects a host sync with "operation not permitted when stream is capturing", and torch
cannot always unwind such a failure cleanly; so the CUDA driver's warmup run and every emulated capture run
under this guard. It sees a sync in two ways:
- aten ops, through a dispatch mode (cgcompile/sync_rules.py says which ops sync, for the plan too);
  higher-order operators (activation checkpointing's `run_and_save_rng_state`, ...) pass through it, their inner
  op checked too;
- Python-level reads that bypass the dispatcher where a mode cannot see them, e.g. inside a custom op's
  Python kernel: `Tensor.item/tolist/cpu/numpy`, `bool/int/float(tensor)`, and `torch.cuda.synchronize`,
  `empty_cache` and stream/event `synchronize`. These are patched while a guard is active on any thread, and
  raise only on the guarded thread. With `on_cuda`, a tensor read counts only when it is a CUDA tensor; the
  emulate driver models the CPU as the device, so there every such read is a sync.
Syncs inside a compiled kernel (C++/CUDA) stay invisible; on CUDA the capture itself catches those.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

from ... import _compat
from ...sync_rules import DEVICE_SYNCS, TENSOR_READS
from .base import SYNC_MESSAGE, CaptureError
from .host_sync import host_sync_reason

__all__ = ["HostSyncGuard", "capture_guard"]


class HostSyncGuard(_compat.TorchDispatchMode):
    """Raises CaptureError at the first aten op that would sync with the host, before it runs."""

    supports_higher_order_operators = True

    def __init__(self, on_cuda: bool = False):
        super().__init__()
        self.on_cuda = on_cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = host_sync_reason(func, args, kwargs, self.on_cuda)
        if reason is None and args and isinstance(args[0], torch._ops.OpOverload):
            reason = host_sync_reason(args[0], args[1:], kwargs, self.on_cuda)  # a HOP wrapping one op
        if reason is not None:
            raise CaptureError(f"{reason}: {SYNC_MESSAGE}")
        return func(*args, **kwargs)


# --- Python-level syncs --------------------------------------------------------------------------------------

_local = threading.local()  # .on_cuda: None outside a guard on this thread
_lock = threading.Lock()
_installed: Dict[Tuple[Any, str], Any] = {}  # (owner, attribute) -> its own entry (or _INHERITED), while patched
_INHERITED = object()  # the attribute came from a base class (torch.Tensor's methods live on TensorBase)
_active = 0


def _guarded_on_this_thread() -> Any:
    return getattr(_local, "on_cuda", None)


def _tensor_read(original: Callable, what: str) -> Callable:
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        on_cuda = _guarded_on_this_thread()
        if on_cuda is not None and (not on_cuda or self.device.type == "cuda"):
            raise CaptureError(f"{what} reads device memory on the host: {SYNC_MESSAGE}")
        return original(self, *args, **kwargs)

    return read


def _device_sync(original: Callable, what: str) -> Callable:
    def sync(*args: Any, **kwargs: Any) -> Any:
        if _guarded_on_this_thread() is not None:
            raise CaptureError(f"{what} waits for the device: {SYNC_MESSAGE}")
        return original(*args, **kwargs)

    return sync


def _patches() -> List[Tuple[Any, str, Callable]]:
    found = [(torch.Tensor, name, _tensor_read(getattr(torch.Tensor, name), read.what))
             for name, read in TENSOR_READS.items()]
    for owner, name, what in DEVICE_SYNCS:
        found.append((owner, name, _device_sync(getattr(owner, name), what)))
    return found


@contextlib.contextmanager
def _python_reads_guarded(on_cuda: bool) -> Iterator[None]:
    global _active
    with _lock:
        if _active == 0:
            for owner, name, patched in _patches():
                _installed[(owner, name)] = owner.__dict__.get(name, _INHERITED)
                setattr(owner, name, patched)
        _active += 1
    previous = _guarded_on_this_thread()
    _local.on_cuda = on_cuda
    try:
        yield
    finally:
        _local.on_cuda = previous
        with _lock:
            _active -= 1
            if _active == 0:
                for (owner, name), original in _installed.items():
                    if original is _INHERITED:
                        delattr(owner, name)
                    else:
                        setattr(owner, name, original)
                _installed.clear()


@contextlib.contextmanager
def capture_guard(on_cuda: bool = False) -> Iterator[None]:
    """Raise CaptureError at the first host sync in the body (aten ops and Python-level reads)."""
    with _python_reads_guarded(on_cuda), HostSyncGuard(on_cuda):
        yield

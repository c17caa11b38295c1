"""The emulate driver: CUDA-graph capture and replay on the CPU, enforcing the CUDA-graph contract strictly.

Nearly every change is checked only through this driver (a GPU is rarely at hand), so every rule a real capture
enforces and this driver does not model ships untested. What it models:
- Buffers: capture runs fn once on the static inputs and keeps its output tensors as the static outputs, filled
  with garbage (a real capture runs no kernel); a replay re-runs fn on the static inputs and copies the results
  into those same output tensors. A runtime that forgets to copy an input, reads from the wrong place, or hands
  out a static output a later replay overwrites fails here as on a GPU.
- Nothing survives a capture: writes are undone, random generators and global state restored.
- Host syncs fail the capture (runtime/drivers/capture_guard.py): aten ops that read device values, data-dependent shapes,
  Python data turned into tensors (a host-to-device copy), and Python-level reads (`.item()`, `.tolist()`,
  `.cpu()`, `bool(t)`, `torch.cuda.synchronize()`) also from inside a custom op's Python kernel.
- What the graph recorded is what it replays: capture records every aten op with its non-tensor arguments and
  which storage each tensor argument is (a static input, memory the graph allocates, or external memory the code
  reads, e.g. a closed-over tensor). Each replay is checked against that record: a changed Python value (an
  optimizer's lr), another op sequence, or an external tensor replaced by another raises StaleReplayError naming
  the op and the user's line, where a CUDA graph would silently keep what it captured.
- Memory pools: graphs captured into one pool share memory, so a graph's replay overwrites the memory of graphs
  captured after it into the same pool (their temporaries may lie where its own were); a replay here fills the
  outputs of those later graphs with garbage, so a pool or arena rule that replays at the wrong time fails the
  parity tests. A failed capture leaves its pool "recording", as torch does.
- Version counters: a graph's kernels bump none (autograd never sees them), so neither capture nor replay leaves
  the version of an input it writes changed; the runtime bumps those itself, as aot's wrapper does around a
  compiled graph, or autograd's check of a saved tensor would miss the write.
- Higher-order operators (activation checkpointing's run_and_save_rng_state) pass through every check.
Not modelled: timing and streams; memory use (no pool sizes); host syncs inside compiled kernels (C++ of an
Inductor-compiled graph); which tensors live on the host rather than the device (every tensor is the device's
here; on an accelerator the plan keeps every read of a host tensor input eager, passes/host_tensors.py, tested on
the meta device); writes inside a higher-order op.
RNG: capture leaves every generator as it found it, and each replay draws from the CPU default generator as the
eager call would have (the same numbers, in the same order).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ... import _compat
from .capture_guard import capture_guard
from .emulated_pool import EmulatedPool, poison
from .base import CaptureError, CapturedGraph, Driver, Fn, StaleReplayError, emulating
from .thread_state import preserved_global_state
from ..tensors import copy_into
from .user_frames import user_location
from .write_undo import WriteUndo

__all__ = ["REPLAY_RANGE", "EmulateDriver", "EmulatedGraph"]

# profiler range around an emulated replay: the ops inside stand for one graph launch (see cgcompile/profiling.py)
REPLAY_RANGE = "cgcompile::graph_replay"


def _fresh_outputs(outputs: Sequence[Any], inputs: Sequence[Any]) -> List[torch.Tensor]:
    """The outputs a capture allocated (in its pool): not sharing memory with an input, each storage once."""
    taken = {_compat.storage_key(t)[0] for t in inputs if isinstance(t, torch.Tensor)}
    fresh: List[torch.Tensor] = []
    for out in outputs:
        if isinstance(out, torch.Tensor):
            ptr = _compat.storage_key(out)[0]
            if ptr and ptr not in taken:
                taken.add(ptr)
                fresh.append(out)
    return fresh


# --- the op record ---------------------------------------------------------------------------------------------

_LOCAL = "local"  # a tensor the graph's own run allocated


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _describe(value: Any) -> str:
    if isinstance(value, tuple) and value and value[0] == "static":
        return "a static input"
    if isinstance(value, tuple) and value and value[0] == "external":
        return "an external tensor (read in place at capture)"
    if isinstance(value, str) and value == _LOCAL:
        return "a tensor the graph computes"
    return repr(value)


def _recorded(func: Any) -> bool:
    """Ops that run device work: profiler ranges (a new handle object per run) record nothing a graph keeps."""
    return getattr(func, "namespace", None) != "profiler"


class _OpRecorder(_compat.TorchDispatchMode):
    """Records each op fn runs during capture: (op, its arguments with every tensor replaced by which storage it
    is). External storages (neither a static input nor allocated by fn) still alive when fn returned are the
    ones a graph reads in place forever; they are kept alive, as a CUDA graph needs their address to stay."""

    supports_higher_order_operators = True

    def __init__(self, static_ptrs: Set[int]):
        super().__init__()
        self.static_ptrs = static_ptrs
        self.produced: Set[int] = set()
        self.candidates: Dict[int, List[weakref.ref]] = {}
        self.ops: List[Tuple[Any, list]] = []

    def token(self, t: torch.Tensor) -> Any:
        ptr = _compat.storage_key(t)[0]
        if not ptr:
            return _LOCAL
        if ptr in self.static_ptrs:
            return ("static", ptr)
        if ptr in self.produced:
            return _LOCAL
        self.candidates.setdefault(ptr, []).append(weakref.ref(t))
        return ("external", ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _recorded(func):
            return func(*args, **kwargs)
        leaves, _ = _compat.tree_flatten((args, kwargs))
        self.ops.append((func, [self.token(x) if isinstance(x, torch.Tensor) else x for x in leaves]))
        out = func(*args, **kwargs)
        for t in _compat.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ptr = _compat.storage_key(t)[0]
                if ptr and ptr not in self.static_ptrs and ptr not in self.candidates:
                    self.produced.add(ptr)
        return out

    def finish(self, outputs: Sequence[Any]) -> "OpRecord":
        """The record of this capture: external storages alive now (fn has returned) besides its outputs are
        read in place; the others were temporaries fn made out of the dispatcher's sight (compiled kernels)."""
        returned = {_compat.storage_key(t)[0] for t in outputs if isinstance(t, torch.Tensor)}
        kept: Dict[int, torch.Tensor] = {}
        for ptr, refs in self.candidates.items():
            alive = next((t for t in (r() for r in refs) if t is not None), None)
            if alive is not None and ptr not in returned:
                kept[ptr] = alive.detach()
        ops = [(func, [x if not (isinstance(x, tuple) and x and x[0] == "external" and x[1] not in kept) else _LOCAL
                       for x in leaves]) for func, leaves in self.ops]
        return OpRecord(ops, self.static_ptrs, kept)


class OpRecord:
    """What a capture recorded (see _OpRecorder); `check()` gives the mode a replay runs under."""

    def __init__(self, ops: List[Tuple[Any, list]], static_ptrs: Set[int], external: Dict[int, torch.Tensor]):
        self.ops = ops
        self.static_ptrs = static_ptrs
        self.external = external  # ptr -> tensor: held, so the address stays the graph's

    def token(self, t: torch.Tensor) -> Any:
        ptr = _compat.storage_key(t)[0]
        if ptr and ptr in self.static_ptrs:
            return ("static", ptr)
        if ptr and ptr in self.external:
            return ("external", ptr)
        return _LOCAL


class _Checker(_compat.TorchDispatchMode):
    """Runs a replay's ops, raising StaleReplayError at the first one that differs from the record."""

    supports_higher_order_operators = True

    def __init__(self, record: OpRecord, name: str):
        super().__init__()
        self.record = record
        self.name = name
        self.index = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _recorded(func):
            return func(*args, **kwargs)
        ops = self.record.ops
        if self.index >= len(ops):
            self.fail(f"runs {func} after the {len(ops)} ops it captured")
        captured, expected = ops[self.index]
        self.index += 1
        if func is not captured:
            self.fail(f"runs {func} where its capture ran {captured} (op {self.index}): the code took another path "
                      f"than at capture")
        leaves, _ = _compat.tree_flatten((args, kwargs))
        for position, (value, before) in enumerate(zip(leaves, expected)):
            now = self.record.token(value) if isinstance(value, torch.Tensor) else value
            if not _same(now, before):
                self.fail(f"calls {func} with argument {position} = {_describe(now)} where its capture had "
                          f"{_describe(before)}: a CUDA graph keeps the value or tensor it captured")
        if len(leaves) != len(expected):
            self.fail(f"calls {func} with {len(leaves)} arguments where its capture had {len(expected)}")
        return func(*args, **kwargs)

    def done(self) -> None:
        if self.index != len(self.record.ops):
            self.fail(f"ran {self.index} ops where its capture ran {len(self.record.ops)}")

    def fail(self, what: str) -> None:
        raise StaleReplayError(
            f"{self.name} {what}, at {user_location()}. On a GPU the graph would silently replay what it captured. "
            f"Pass a value that changes as a tensor (e.g. lr=torch.tensor(...)), or keep it fixed.")


def _versioned(values: Sequence[Any]) -> List[torch.Tensor]:
    """The tensors among `values` that have a version counter (an inference tensor, made under inference_mode, has
    none)."""
    return [v for v in values if isinstance(v, torch.Tensor) and not v.is_inference()]


# --- the driver ------------------------------------------------------------------------------------------------


class EmulatedGraph(CapturedGraph):
    """What EmulateDriver.capture returns: replay() re-runs fn on the static inputs into the static outputs,
    checked against the capture's op record, and overwrites the memory of later graphs of its pool."""

    def __init__(self, fn: Fn, static_inputs: Sequence[Any], static_outputs: Sequence[Any], record: OpRecord,
                 pool: Optional[EmulatedPool], written: Sequence[torch.Tensor] = ()):
        super().__init__(static_inputs, static_outputs)
        self.fn = fn
        # the inputs it writes with a version counter (shared with the caller's tensors): it comes out unchanged
        self.written = list(written)
        self.record = record
        self.pool_memory = _fresh_outputs(static_outputs, static_inputs)
        self.pool = pool
        self.position = pool.add(self) if pool is not None else -1

    def replay(self) -> List[Any]:
        with torch.no_grad(), torch.profiler.record_function(REPLAY_RANGE):
            versions = [t._version for t in self.written]
            checker = _Checker(self.record, "a graph replay")
            with checker:
                fresh = self.fn(list(self.static_inputs))
            checker.done()
            if self.written:
                _compat.set_versions(self.written, versions)
            for static, new in zip(self.static_outputs, fresh):
                if not isinstance(static, torch.Tensor) or new is static:
                    continue
                if (new.data_ptr() == static.data_ptr() and new.shape == static.shape
                        and new.stride() == static.stride()):
                    continue  # the output aliases an input buffer: already in place, as on a GPU
                copy_into(static, new)  # an expanded output: its core, as the GPU kernel wrote it
            if self.pool is not None:
                self.pool.replayed(self.position)
        return self.static_outputs


class EmulateDriver(Driver):
    """CPU emulation of CUDA-graph capture/replay with the same contract (see the module docstring)."""

    name = "emulate"

    def __init__(self) -> None:
        super().__init__()
        self._recording: set = set()  # pools a failed capture left "recording", as torch's allocators do
        self._pools: Dict[Any, EmulatedPool] = {}

    def new_pool(self) -> Any:
        return object()

    def release(self) -> None:
        super().release()
        self._pools.clear()

    def capture(self, fn: Fn, static_inputs: Sequence[Any], pool: Any = None, *,
                warmup: bool = True, written: Sequence[int] = ()) -> CapturedGraph:
        pool = self.live_pool(pool)
        if pool is not None and pool in self._recording:  # what CUDAGraph.capture_begin raises
            raise CaptureError("CUDA graph capture failed: beginAllocateToPool: already recording to mempool_id "
                               "(emulated: an earlier capture into this pool failed)")
        undo = WriteUndo([static_inputs[i] for i in written])
        changed = _versioned([static_inputs[i] for i in written])
        versions = [t._version for t in changed]
        recorder = _OpRecorder({_compat.storage_key(t)[0] for t in static_inputs if isinstance(t, torch.Tensor)})
        try:
            # A real capture runs nothing: no write (undo), no random draw and no state change may survive it.
            with preserved_global_state(rng=True), emulating(), capture_guard(), undo, recorder, torch.no_grad():
                outputs = list(fn(list(static_inputs)))
        except BaseException:
            # torch leaves a pool whose capture failed marked as recording (the host allocator's side cannot be
            # ended from Python); emulate that, and retire it like the CUDA driver does.
            if pool is not None:
                self._recording.add(pool)
                self.retire_pool(pool)
            raise
        finally:
            undo.restore()
            if changed:
                _compat.set_versions(changed, versions)
        graph = EmulatedGraph(fn, static_inputs, outputs, recorder.finish(outputs),
                              self._pools.setdefault(pool, EmulatedPool()) if pool is not None else None, changed)
        poison(graph.pool_memory)
        return graph

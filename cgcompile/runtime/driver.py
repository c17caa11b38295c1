"""Capture/replay drivers: one small interface, three implementations.

`driver.capture(fn, static_inputs, pool)` runs `fn(list_of_inputs) -> list_of_outputs` so that later
`graph.replay()` re-executes it reading `static_inputs` and writing the *same* output tensor objects it
returned at capture (`graph.static_outputs`). The runtime (partition_runner.py, graph_family.py, graph.py,
model_runtime.py) owns all buffer logic: what to copy in, what to hand out, when a graph may be replayed.
Drivers only capture and replay.

- `cuda`: real CUDA graphs (torch.cuda.CUDAGraph), captured on a side stream into a caller-chosen pool.
- `emulate`: a CPU stand-in with the same buffer semantics, so the runtime's aliasing and copy logic is
  exercised exactly as on a GPU (see EmulateDriver for what it cannot imitate).
- `eager`: no capture at all; replay just calls fn on the static inputs.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch

from .. import _compat
from ..passes.common import schema_writes
from .global_state import preserved_global_state
from .host_sync import host_sync_reason
from .layout import broadcast_core, copy_into

__all__ = ["CaptureError", "CapturedGraph", "CudaDriver", "Driver", "EagerDriver", "EmulateDriver",
           "get_driver", "is_capturing", "release_cuda_graphs"]

Fn = Callable[[list], Sequence[Any]]

_SYNC_MESSAGE = "operation not permitted when stream is capturing"


class CaptureError(RuntimeError):
    """fn cannot be captured (a host sync, a CUDA capture error); the runtime then runs it eagerly."""


class CapturedGraph:
    """A captured fn. replay() re-runs it on `static_inputs` and returns `static_outputs` (same objects)."""

    def __init__(self, static_inputs: Sequence[Any], static_outputs: Sequence[Any], pool_bytes: int = 0):
        self.static_inputs = list(static_inputs)
        self.static_outputs = list(static_outputs)
        self.pool_bytes = pool_bytes  # device memory reserved while capturing (CUDA only)

    def replay(self) -> List[Any]:
        raise NotImplementedError


class Driver:
    """Captures callables. `captures` is False for the eager driver (the runtime then skips all buffer work).

    Pool tokens stay valid across failures: a capture that fails may leave its pool unusable (torch keeps it
    marked as recording, see CudaDriver), so the driver retires it and later captures with the same token go
    to a fresh pool (`live_pool`). Graphs in the replacement share no memory with the old pool's: safe.
    """

    name = "driver"
    captures = True

    def __init__(self) -> None:
        self._replaced: dict = {}  # retired pool -> the pool that stands in for it

    def new_pool(self) -> Any:
        """A memory-pool token for capture(); graphs captured with the same token share memory."""
        return None

    def live_pool(self, pool: Any) -> Any:
        """The pool a capture with token `pool` really uses: itself, or what replaced it after a failure."""
        while pool is not None and pool in self._replaced:
            pool = self._replaced[pool]
        return pool

    def retire_pool(self, pool: Any) -> None:
        """A failed capture left `pool` unusable: later captures with its token use a fresh pool."""
        if pool is not None:
            self._replaced[pool] = self.new_pool()

    def release(self) -> None:
        """Drop what the driver holds between captures (side stream, pool replacements)."""
        self._replaced.clear()

    def warmup_stream(self) -> Any:
        """A context for eager warmup runs of code that will be captured later (no-op off CUDA)."""
        return contextlib.nullcontext()

    def capture(self, fn: Fn, static_inputs: Sequence[Any], pool: Any = None, *,
                warmup: bool = True) -> CapturedGraph:
        """`warmup=False` skips the driver's own pre-capture run, for callers that warmed up themselves and
        whose fn has side effects that must not happen twice (a whole training step)."""
        raise NotImplementedError


# --- capture state, host-sync guard -------------------------------------------------------------------------------------

_state = threading.local()


def is_capturing() -> bool:
    """True while a driver is capturing on this thread: the emulate flag, or a CUDA stream capture.

    The emulate analogue of torch.cuda.is_current_stream_capturing(), so code (and tests) can refuse work
    that a real capture would reject.
    """
    if getattr(_state, "emulating", False):
        return True
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def _emulating():
    previous = getattr(_state, "emulating", False)
    _state.emulating = True
    try:
        yield
    finally:
        _state.emulating = previous


# profiler range around an emulated replay: the ops inside stand for one graph launch (see cgcompile/profiling.py)
REPLAY_RANGE = "cgcompile::graph_replay"


class _HostSyncGuard(_compat.TorchDispatchMode):
    """Raises CaptureError at the first op that would sync with the host, before it runs.

    Used while emulating capture (so CPU runs fail where CUDA capture would) and on the CUDA driver's warmup
    run (so most sync ops fail before cudaStreamBeginCapture, which torch cannot always unwind cleanly).
    Custom ops that sync *inside* their kernel are invisible here; on CUDA the capture itself catches those.
    """

    def __init__(self, on_cuda: bool = False):
        super().__init__()
        self.on_cuda = on_cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = host_sync_reason(func, args, kwargs, self.on_cuda)
        if reason is not None:
            raise CaptureError(f"{reason}: {_SYNC_MESSAGE}")
        return func(*args, **kwargs)


# --- eager ---------------------------------------------------------------------------------------------------


class _EagerGraph(CapturedGraph):
    def __init__(self, fn: Fn, static_inputs: Sequence[Any]):
        super().__init__(static_inputs, [])
        self.fn = fn

    def replay(self) -> List[Any]:
        with torch.no_grad():
            self.static_outputs = list(self.fn(list(self.static_inputs)))
        return self.static_outputs


class EagerDriver(Driver):
    """No capture: `replay()` calls fn each time (fresh outputs). Used where capture is off or impossible."""

    name = "eager"
    captures = False

    def capture(self, fn: Fn, static_inputs: Sequence[Any], pool: Any = None, *,
                warmup: bool = True) -> CapturedGraph:
        return _EagerGraph(fn, static_inputs)


# --- emulate -------------------------------------------------------------------------------------------------


def _poison(outputs: Sequence[Any], inputs: Sequence[Any]) -> None:
    """Fill outputs with garbage, as after a real capture (which records kernels but runs none).

    Outputs sharing memory with an input are left alone: writing them would corrupt that input.
    """
    input_storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    with torch.no_grad():
        for out in outputs:
            if not isinstance(out, torch.Tensor) or out.untyped_storage().data_ptr() in input_storages:
                continue
            out = broadcast_core(out)  # an expanded output: each element once
            if out.is_floating_point() or out.is_complex():
                out.fill_(float("nan"))
            elif out.dtype == torch.bool:
                out.fill_(True)
            else:
                try:
                    out.fill_(torch.iinfo(out.dtype).max)
                except (TypeError, RuntimeError):  # exotic dtypes: leave as computed
                    pass


class EmulatedGraph(CapturedGraph):
    """What EmulateDriver.capture returns: replay() re-runs fn on the static inputs into the static outputs."""

    def __init__(self, fn: Fn, static_inputs: Sequence[Any], static_outputs: Sequence[Any]):
        super().__init__(static_inputs, static_outputs)
        self.fn = fn

    def replay(self) -> List[Any]:
        with torch.no_grad(), torch.profiler.record_function(REPLAY_RANGE):
            fresh = self.fn(list(self.static_inputs))
            for static, new in zip(self.static_outputs, fresh):
                if not isinstance(static, torch.Tensor) or new is static:
                    continue
                if (new.data_ptr() == static.data_ptr() and new.shape == static.shape
                        and new.stride() == static.stride()):
                    continue  # the output aliases an input buffer: already in place, as on a GPU
                copy_into(static, new)  # an expanded output: its core, as the GPU kernel wrote it
        return self.static_outputs


class EmulateDriver(Driver):
    """CPU emulation of CUDA-graph capture/replay with the same buffer contract.

    capture(): runs fn once on the static inputs (flagging `is_capturing()` and raising CaptureError on host
    syncs, like CUDA's "operation not permitted when stream is capturing"), keeps its output tensors as the
    static outputs and fills them with garbage (a real capture runs nothing). replay(): re-runs fn on the
    *static input buffers* and copies the results into the *same* output tensors. So a runtime that forgets
    to copy an input, reads inputs from the wrong place, or hands out a static output that a later replay
    overwrites fails on CPU exactly as it would on a GPU.

    Limits: it cannot tell whether fn reads tensors other than its static inputs (a real graph would keep
    reading the captured addresses; emulate reads whatever fn closes over now); Python side effects in fn
    happen on every replay (a real graph runs them only at capture); memory pools are not emulated, so
    pool-sharing mistakes do not show; host syncs hidden inside a custom op's kernel are not detected.
    RNG: capture leaves every generator as it found it, and each replay draws from the CPU default generator
    as the eager call would have (the same numbers, in the same order).
    """

    name = "emulate"

    def __init__(self) -> None:
        super().__init__()
        self._recording: set = set()  # pools a failed capture left "recording", as torch's allocators do

    def new_pool(self) -> Any:
        return object()

    def capture(self, fn: Fn, static_inputs: Sequence[Any], pool: Any = None, *,
                warmup: bool = True) -> CapturedGraph:
        pool = self.live_pool(pool)
        if pool is not None and pool in self._recording:  # what CUDAGraph.capture_begin raises
            raise CaptureError("CUDA graph capture failed: beginAllocateToPool: already recording to mempool_id "
                               "(emulated: an earlier capture into this pool failed)")
        undo = _WriteUndo()
        try:
            # A real capture runs nothing: no write (undo), no random draw and no state change may survive it.
            with preserved_global_state(rng=True), _emulating(), _HostSyncGuard(), undo, torch.no_grad():
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
        _poison(outputs, static_inputs)
        return EmulatedGraph(fn, static_inputs, outputs)


class _WriteUndo(_compat.TorchDispatchMode):
    """Remembers every storage fn writes in place, as it was before the first write, so the emulated capture
    can be undone: a real capture records kernels and runs none, so parameters, optimizer state and inputs
    must come out of it unchanged (a captured optimizer step must not also have stepped once)."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in schema_writes(func._schema, args, kwargs):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                if storage.data_ptr() not in self.saved and storage.nbytes():
                    self.saved[storage.data_ptr()] = (storage, storage.clone())
        return func(*args, **kwargs)

    def restore(self) -> None:
        for storage, before in self.saved.values():
            storage.copy_(before)
        self.saved.clear()


# --- cuda ----------------------------------------------------------------------------------------------------


class _CudaGraph(CapturedGraph):
    def __init__(self, graph: Any, static_inputs: Sequence[Any], static_outputs: Sequence[Any],
                 pool_bytes: int):
        super().__init__(static_inputs, static_outputs, pool_bytes)
        self.graph = graph
        _LIVE.add(self)

    def replay(self) -> List[Any]:
        if self.graph is None:
            raise CaptureError("this CUDA graph was released (cgcompile.release() or torch._dynamo.reset())")
        self.graph.replay()  # on the current stream, after the runtime's input copies
        return self.static_outputs

    def release(self) -> None:
        """Destroy the CUDA graph now (CUDAGraph.reset, public in 2.11 and 2.13), whoever still holds us."""
        if self.graph is not None:
            self.graph.reset()
            self.graph = None


_LIVE: "weakref.WeakSet[_CudaGraph]" = weakref.WeakSet()


def release_cuda_graphs() -> None:
    """Destroy every CUDA graph this process captured through the CUDA driver that is still alive."""
    for graph in list(_LIVE):
        graph.release()


class CudaDriver(Driver):
    """torch.cuda.CUDAGraph capture on a side stream, `capture_error_mode="thread_local"`.

    Before capture, fn runs once on the side stream (torch's documented warmup: lazy cuBLAS/cuDNN init must not
    happen inside a capture) under the host-sync guard. Pools come from torch.cuda.graph_pool_handle(); the
    runtime decides which graphs share one. RNG: torch registers the default CUDA generator with a capture by
    itself (2.11/2.13: a generator used during capture creates its per-capture state lazily, see
    CUDAGeneratorImpl::philox_cuda_state and CUDAGraph::capture_end), so each replay draws fresh numbers; we
    register nothing explicitly (registering an unused generator is not safe on every version).
    """

    name = "cuda"

    def __init__(self, device: torch.device):
        super().__init__()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._stream: Optional[torch.cuda.Stream] = None

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def warmup_stream(self):
        """Run warmup on the capture's side stream, as torch's whole-network capture recipe does: per-stream
        library state (cuBLAS workspaces, ...) then exists before the capture on that stream."""
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _side_stream(self) -> "torch.cuda.Stream":
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def capture(self, fn: Fn, static_inputs: Sequence[Any], pool: Any = None, *,
                warmup: bool = True) -> CapturedGraph:
        # explicit even when private, so a failed capture can release it
        pool = self.live_pool(pool) if pool is not None else self.new_pool()
        stream = self._side_stream()
        with torch.cuda.device(self.device), torch.no_grad():
            current = torch.cuda.current_stream()
            stream.wait_stream(current)
            if warmup:
                # The warmup's draws must not shift the generator: the replay after capture draws what eager would.
                with preserved_global_state(rng=True), torch.cuda.stream(stream), _HostSyncGuard(on_cuda=True):
                    fn(list(static_inputs))  # result dropped at once: its memory is free for the capture
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # torch.cuda.graph does this too; before measuring, so the delta is the pool's
            reserved = torch.cuda.memory_reserved(self.device)
            graph = torch.cuda.CUDAGraph()
            failure: List[BaseException] = []
            try:
                with preserved_global_state(), \
                        torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    try:
                        outputs = list(fn(list(static_inputs)))
                    except BaseException as exc:
                        failure.append(exc)
                        raise
            except Exception as exc:
                self._undo_failed_capture(graph, pool, stream, current)
                cause = failure[0] if failure else exc
                raise CaptureError(f"CUDA graph capture failed: {cause}") from cause
            pool_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved)
        return _CudaGraph(graph, static_inputs, outputs, pool_bytes)

    def _undo_failed_capture(self, graph: Any, pool: Any, stream: Any, current: Any) -> None:
        """Leave the process as it was before the capture, so the next one (same token or not) succeeds.

        torch (2.11, 2.13: aten/src/ATen/cuda/CUDAGraph.cpp) unwinds a failed capture only partly:
        CUDAGraph.capture_end raises at cudaStreamEndCapture's error *before* ending the device and host
        allocators' recording to the pool, and torch.cuda.graph.__exit__ then skips restoring the stream; a
        failure inside capture_begin (the host allocator refusing a pool) leaves the device allocator recording.
        So: end a capture still open on the side stream, make the caller's stream current again, end and
        release the device allocator's recording (only if it is still on: a successful capture_end already
        did both), and retire the pool token, because the host allocator's recording cannot be ended from
        Python (it raises "beginAllocateToPool: already recording to mempool_id" on the next capture into it).
        The graph object is kept: the allocators keep a callback that reads it. The side stream is replaced.
        """
        with torch.cuda.stream(stream):
            if torch.cuda.is_current_stream_capturing():  # capture_end refused (e.g. called on another stream)
                try:
                    graph.capture_end()
                except Exception:
                    pass
        torch.cuda.set_stream(current)
        if _compat.cuda_end_allocate_to_pool(self.device, pool):
            _compat.cuda_release_pool(self.device, pool)  # balances capture_begin's reference on the pool
        if not _capture_succeeded(graph):
            _ABANDONED_GRAPHS.append(graph)
            self.retire_pool(pool)
        self._stream = None

    def release(self) -> None:
        super().release()
        self._stream = None


# Graphs whose capture failed half way. torch's allocators may still hold a stream filter that reads the graph
# object (CUDAGraph::create_allocate_filter captures `this`), so it must outlive them: a few bytes each, no
# CUDA graph and no pool memory.
_ABANDONED_GRAPHS: List[Any] = []


def _capture_succeeded(graph: Any) -> bool:
    """CUDAGraph.pool() (public, 2.11 and 2.13) raises unless capture_end completed."""
    try:
        graph.pool()
        return True
    except Exception:
        return False


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

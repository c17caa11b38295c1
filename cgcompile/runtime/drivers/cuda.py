"""The CUDA driver: real CUDA graphs (torch.cuda.CUDAGraph), captured on a side stream into a caller-chosen pool.

The interface is driver.py's; the runtime decides what to copy in, which pool a graph uses and when it replays.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch

from ... import _compat
from .capture_guard import capture_guard
from .base import CaptureError, CapturedGraph, Driver, Fn
from .thread_state import preserved_global_state
from .timing import CudaEventTimer
from .write_undo import WriteUndo

log = logging.getLogger("cgcompile")

__all__ = ["CudaDriver", "PoolLedger", "capture_failure", "end_generator_capture", "release_cuda_graphs"]


class _CudaGraph(CapturedGraph):
    def __init__(self, graph: Any, static_inputs: Sequence[Any], static_outputs: Sequence[Any],
                 pool_bytes: int, ledger: "PoolLedger", pool: Any):
        super().__init__(static_inputs, static_outputs, pool_bytes)
        self.graph = graph
        self._left_pool = ledger.track(self, pool)  # called at release(), or when this object is collected
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
            self._left_pool()


_LIVE: "weakref.WeakSet[_CudaGraph]" = weakref.WeakSet()


def release_cuda_graphs() -> None:
    """Destroy every CUDA graph this process captured through the CUDA driver that is still alive."""
    for graph in list(_LIVE):
        graph.release()


class PoolLedger:
    """How many live graphs each pool of a CudaDriver holds, so a pool none holds any more is not captured into.

    torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp, 2.11 and 2.13) counts the graphs using a private
    pool: capture_begin increments (create_or_incref_pool), a graph's reset or destruction decrements
    (releasePool). At 0 the pool only waits to be freed, and is removed once none of its blocks is allocated; until
    then a capture into it fails the internal assert `use_count > 0`. A graph's outputs kept by anyone (a
    held output, an arena) keep blocks allocated, so a token all of whose graphs were reset (a single-graph frame
    whose parameter moved: the old graph is dropped, then the new one captured with the same token) gets a fresh
    pool instead (CudaDriver.pool_for_capture). Graphs that share nothing with the old pool's lose nothing by it.
    """

    def __init__(self) -> None:
        self._live: dict = {}  # pool -> live graphs captured into it

    def track(self, graph: Any, pool: Any) -> Callable[[], None]:
        """Count `graph` in `pool` until the returned callable runs (at its reset) or `graph` is collected,
        whichever comes first; once either way."""
        self._live[pool] = self._live.get(pool, 0) + 1
        left = weakref.finalize(graph, self._leave, pool)
        left.atexit = False
        return left

    def _leave(self, pool: Any) -> None:
        self._live[pool] -= 1

    def emptied(self, pool: Any) -> bool:
        """Did `pool` hold graphs, all of which are gone now?"""
        return self._live.get(pool) == 0

    def live_graphs(self, pool: Any) -> int:
        return self._live.get(pool, 0)


class CudaDriver(Driver):
    """torch.cuda.CUDAGraph capture on a side stream, `capture_error_mode="thread_local"`.

    Before capture, unless the caller warmed up on the side stream itself (`warmup=False`), fn runs once on the
    side stream (torch's documented warmup: lazy cuBLAS/cuDNN init must not happen inside a capture) under the
    host-sync guard, its writes undone. Pools come from torch.cuda.graph_pool_handle(); the
    runtime decides which graphs share one. RNG (2.11, 2.12, 2.13; see _compat's generator notes): capture_begin
    registers the capture device's default generator, so each replay draws fresh numbers from it; a torch.Generator
    of the user's own is not registered (these releases register no generator lazily) and drawing from it inside a
    capture fails the capture: that partition runs eagerly, the reason says why. After a capture that failed inside
    CUDA, torch 2.11 leaves the default generator in capture mode; _undo_failed_capture ends that.
    """

    name = "cuda"

    def __init__(self, device: torch.device):
        super().__init__()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._stream: Optional[torch.cuda.Stream] = None
        self.pools = PoolLedger()
        self.timer = CudaEventTimer(self.device)

    def device_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def pool_for_capture(self, pool: Any) -> Any:
        """The pool a capture with token `pool` uses: what stands in for it after a failure (live_pool), a fresh
        one when the token is None or its pool's graphs were all reset (PoolLedger: torch would assert)."""
        pool = self.live_pool(pool) if pool is not None else self.new_pool()
        if self.pools.emptied(pool):
            self.retire_pool(pool)
            pool = self.live_pool(pool)
        return pool

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
                warmup: bool = True, written: Sequence[int] = ()) -> CapturedGraph:
        pool = self.pool_for_capture(pool)  # explicit even when private, so a failed capture can release it
        stream = self._side_stream()
        with torch.cuda.device(self.device), torch.no_grad():
            current = torch.cuda.current_stream()
            stream.wait_stream(current)
            if warmup:
                # The warmup's draws must not shift the generator, nor its writes survive: the replay after capture
                # draws and writes what eager would.
                undo = WriteUndo([static_inputs[i] for i in written])
                with preserved_global_state(rng=True), torch.cuda.stream(stream), capture_guard(on_cuda=True), undo:
                    fn(list(static_inputs))  # result dropped at once: its memory is free for the capture
                with torch.cuda.stream(stream):
                    undo.restore()
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
                raise capture_failure(cause) from cause
            pool_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved)
        return _CudaGraph(graph, static_inputs, outputs, pool_bytes, self.pools, pool)

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
        On torch 2.11 the device's default generator stays in capture mode (every eager draw raises "Offset
        increment outside graph capture") until a capture completes: end_generator_capture completes one.
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
            if _compat.generator_capture_state_outlives_failure():
                end_generator_capture(self.device)
        self._stream = None

    def release(self) -> None:
        super().release()
        self._stream = None


def capture_failure(cause: BaseException) -> CaptureError:
    """The CaptureError for a failed capture: torch's message, and the fix when the cause is a draw from a
    generator the capture did not register."""
    message = f"CUDA graph capture failed: {cause}"
    if _compat.is_unregistered_generator_error(str(cause)):
        message += (" (the captured code draws from a torch.Generator of its own: CUDA graphs on torch 2.11-2.13 "
                    "register only the device's default generator; draw from the default generator, seeded with "
                    "torch.manual_seed, or keep that code in a cgcompile.eager_region)")
    return CaptureError(message)


def end_generator_capture(device: torch.device) -> None:
    """End the capture mode a failed capture left on `device`'s default generator (torch < 2.12, _compat): complete
    one tiny capture there (its capture_end runs the generator's capture_epilogue), then destroy it. It draws no
    random number, so the generator's offset is unchanged. Best effort: a device that cannot capture now (a sticky
    CUDA error) is left as it is."""
    try:
        with torch.cuda.device(device):
            scratch = torch.zeros(1, device=device)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                scratch.add_(1)  # one kernel: an empty graph warns
            graph.reset()
    except Exception as exc:  # the capture that failed already raised; this one must not hide it
        log.debug("cgcompile: could not end the default generator's capture mode on %s: %s", device, exc)


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

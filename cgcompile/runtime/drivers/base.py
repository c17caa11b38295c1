"""The capture/replay interface every driver implements, and the capture state code can ask about.

`driver.capture(fn, static_inputs, pool)` runs `fn(list_of_inputs) -> list_of_outputs` so that later
`graph.replay()` re-executes it reading `static_inputs` and writing the *same* output tensor objects it
returned at capture (`graph.static_outputs`). The runtime (runtime/local/runner.py, runtime/local/family.py, runtime/local/instance.py,
runtime/local/model_runtime.py) owns all buffer logic: what to copy in, what to hand out, when a graph may be replayed.
Drivers only capture and replay. The implementations: runtime/drivers/cuda.py (real CUDA graphs), runtime/drivers/emulate.py
(the CPU stand-in that enforces the CUDA-graph contract), drivers.py (the eager driver and `get_driver`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Iterator, List, Sequence

import torch

from .timing import Timer

__all__ = ["CaptureError", "CapturedGraph", "Driver", "StaleReplayError", "emulating", "is_capturing"]

Fn = Callable[[list], Sequence[Any]]

SYNC_MESSAGE = "operation not permitted when stream is capturing"


class CaptureError(RuntimeError):
    """fn cannot be captured (a host sync, a CUDA capture error); the runtime then runs it eagerly."""


class StaleReplayError(RuntimeError):
    """A replay would not do what the code does now: a Python value, or the tensor an op reads, changed since
    capture. A CUDA graph keeps what it recorded, so on a GPU this is silently wrong results; the emulate driver
    raises it instead (runtime/drivers/emulate.py)."""


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
    timer: Timer = Timer()  # times partition calls for the benefit rule (timing.py); tests replace it

    def device_bytes(self) -> int:
        """The memory a fractional cuda_graph_memory_budget is a fraction of: the host's RAM off CUDA."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

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
                warmup: bool = True, written: Sequence[int] = ()) -> CapturedGraph:
        """`warmup=False` skips the driver's own pre-capture run, for callers that warmed up themselves and
        whose fn has side effects that must not happen twice (a whole training step). A run the driver makes
        (emulate's capture, CUDA's warmup) leaves the static inputs as it found them: writes ops announce are
        undone (runtime/drivers/write_undo.py), and `written` names the inputs fn writes where no op announces it (a compiled
        kernel), saved before and restored after."""
        raise NotImplementedError


# --- capture state ---------------------------------------------------------------------------------------------

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
def emulating() -> Iterator[None]:
    """Mark this thread as capturing (the emulate driver's capture)."""
    previous = getattr(_state, "emulating", False)
    _state.emulating = True
    try:
        yield
    finally:
        _state.emulating = previous

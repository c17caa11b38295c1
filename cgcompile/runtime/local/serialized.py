"""A compiled frame's calls, one at a time.

Threads may share one compiled model (a server's request threads, inference beside training): its frame's graphs,
their static buffers and the runtime's bookkeeping are one state, so a replay must not start while another
thread's call is still reading or copying out of the same graph memory. Each frame's function runs holding its
ModelRuntime's `calls` lock (its backward graphs take it too: runtime/local/backward_family.py). The lock is
reentrant: activation checkpointing runs a frame's forward inside its backward, on the same thread.

The wrapper is C where it was built (cgcompile/csrc/serialized_call.cpp), so a steady decode step stays free of
cgcompile's Python; the Python one does the same.
"""

from __future__ import annotations

from typing import Any, Callable

from ...native import SERIALIZED_CALL, compiled_host_path

__all__ = ["one_call_at_a_time"]


def one_call_at_a_time(call: Callable[..., Any], runtime: Any) -> Callable[..., Any]:
    """`call` (a frame's function) run holding `runtime.calls`; `.runtime` is `runtime`, as tools read it."""
    if SERIALIZED_CALL is not None and compiled_host_path():
        return SERIALIZED_CALL.SerializedCall(call, runtime.calls, runtime)
    lock = runtime.calls

    def serialized(*args: Any) -> Any:
        with lock:
            return call(*args)

    serialized.runtime = runtime  # type: ignore[attr-defined]
    return serialized

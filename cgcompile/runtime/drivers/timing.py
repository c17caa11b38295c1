"""How long one partition call takes: what the benefit rule (runtime/bank/benefit.py) compares.

Behind one small interface so the clock is the driver's: CUDA events on the cuda driver (what the GPU spent,
not what the host waited), a host clock on the CPU drivers, where a time says nothing about a GPU and tests
replace the timer (`EmulateDriver.timer = ...`) with one that reports the times a test wants. Only warmup calls
and a bounded number of replays after a capture are timed (runtime/local/benefit.py), never a steady replay.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Tuple

import torch

__all__ = ["CudaEventTimer", "Timer"]


class Timer:
    """A host clock (`clock`, seconds). `measure` runs `fn(args)` and returns its result and seconds taken;
    `partition` and `phase` ("eager" or "replay", with the graph kind) name what is timed, for a timer a test
    scripts."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock

    def measure(self, fn: Callable[[Any], Any], args: Any, partition: str, phase: str) -> Tuple[Any, float]:
        start = self.clock()
        out = fn(args)
        return out, self.clock() - start


class CudaEventTimer(Timer):
    """CUDA events around the call on the current stream, waited for at once (only timed calls pay the wait)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def measure(self, fn: Callable[[Any], Any], args: Any, partition: str, phase: str) -> Tuple[Any, float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(self.device)
        start.record(stream)
        out = fn(args)
        end.record(stream)
        end.synchronize()
        return out, start.elapsed_time(end) / 1000.0

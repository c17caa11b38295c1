"""Process-wide runtime counters: proof that capture happened, and why it did not.

`snapshot()` returns a copy (a plain dict, safe to keep); `reset()` zeroes everything; stats.py adds what the live
runtimes report for `cgcompile.stats()`. Updates take a lock, so counters stay exact if partitions run on several threads; the
replay counts, bumped on every replay, are kept per thread instead (each thread writes only its own, no lock on
the replay path) and summed by stats().
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Dict, List

_lock = threading.Lock()


def _zero() -> Dict[str, Any]:
    return {
        "graphs_captured": 0,    # driver captures (forward, backward and inference graphs each count one)
        "eager_fallbacks": [],   # {"partition", "reason"}: each distinct (partition, reason) once
        "recaptures": [],        # {"partition", "reason"}: every re-capture of an existing graph
        "pool_bytes": 0,         # device memory reserved while capturing (CUDA only; 0 elsewhere)
        "capture_seconds": 0.0,  # wall time spent in warmup-compile and capture
        "verify_max_diff": {},   # partition -> largest |captured - eager| seen (option verify)
        "capture_size_overflows": 0,  # calls whose batch exceeded the largest capture size (ran eagerly)
        "graphs_released": 0,    # graph instances released, a forward with its backward counting one (bank policy,
        #                          freed parameters, a frame a recompile superseded)
        "bank_stops": [],        # {"partition", "reason"}: partitions that stopped capturing (sizes, re-capture storm)
        "benefit": {},           # partition -> its measured times and saving (option measure_benefit)
        "padding_withdrawn": [],  # {"partition", "reason"}: a padded partition fell back; its frame runs unpadded
    }


_state = _zero()


class _ReplayCounts:
    """One thread's replays since the last reset: written by that thread alone."""

    __slots__ = ("replays", "steady")

    def __init__(self) -> None:
        self.replays = 0
        self.steady = 0


_thread = threading.local()
_replay_counts: List[_ReplayCounts] = []  # every thread's (a finished thread's too: its replays still count)


def _replays() -> Dict[str, int]:
    """`replays`: graph replays, the run of the call that captured a graph included; `steady_replays`: replays of
    a graph after the call that captured it (what pays for a capture)."""
    return {"replays": sum(c.replays for c in _replay_counts), "steady_replays": sum(c.steady for c in _replay_counts)}


def snapshot() -> Dict[str, Any]:
    """A copy of every counter since the last reset(), the replay counts of every thread summed in."""
    with _lock:
        copied = copy.deepcopy(_state)
    copied.update(_replays())
    return copied


def reuse(partitions: list) -> float:
    """Over partitions' rows (stats()["partitions"]): the share of calls after warmup that a graph captured at an
    earlier call served. What pays for capture: a graph captured and not reused is pure cost."""
    after = sum(p["calls"] - p["warmup_calls"] for p in partitions)
    return round(sum(p["replays"] for p in partitions) / after, 3) if after > 0 else 0.0


def reset() -> None:
    """Zero every counter."""
    global _state
    with _lock:
        _state = _zero()
        for counts in _replay_counts:
            counts.replays = counts.steady = 0


def add(name: str, amount: float = 1) -> None:
    """Increase a numeric counter."""
    with _lock:
        _state[name] += amount


def add_replays(replays: int, steady: int) -> None:
    """Count `replays` graph replays, `steady` of them steady ones (a bool counts 0 or 1), in this thread's counts:
    one replay at a time, or a partition's steady replays in a batch when its clocks are brought up to date
    (runtime/local/runner.py)."""
    try:
        counts = _thread.counts
    except AttributeError:
        counts = _thread.counts = _ReplayCounts()
        with _lock:
            _replay_counts.append(counts)
    counts.replays += replays
    counts.steady += steady


def record(name: str, partition: str, reason: str, *, once: bool = False) -> bool:
    """Append {partition, reason} to a list counter; with once=True skip (and return False) if present."""
    entry = {"partition": partition, "reason": reason}
    with _lock:
        if once and entry in _state[name]:
            return False
        _state[name].append(entry)
        return True


def record_benefit(partition: str, row: Dict[str, Any]) -> None:
    """A partition's measured eager and replay times and saving (runtime/local/benefit.py)."""
    with _lock:
        _state["benefit"][partition] = dict(row)


def record_max(name: str, key: str, value: float) -> None:
    """Keep the largest value seen per key in a dict counter."""
    with _lock:
        table = _state[name]
        table[key] = max(table.get(key, value), value)

"""Process-wide runtime counters: proof that capture happened, and why it did not.

`stats()` returns a snapshot (a plain dict, safe to keep); `reset_stats()` zeroes everything. Tests and
benchmarks assert on these. Updates take a lock, so counters stay exact if partitions run on several threads; the
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
        "graphs_released": 0,    # graphs the bank policy released (not replayed within its window)
        "bank_stops": [],        # {"partition", "reason"}: partitions that stopped capturing (sizes, re-capture storm)
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


def stats() -> Dict[str, Any]:
    """A snapshot of the counters since the last reset_stats(), plus `graphs`: one entry per captured graph
    alive now (partition, label, kind, replays, pool_bytes, static_input_bytes, static_output_bytes, and for a
    partition whose sizes vary its output `arena`, `arena_bytes`, `arena_output_bytes`), `graph_bytes`: what they
    hold together (each arena once), and `partitions`: per captured partition its graph-bank accounting (calls,
    replays, misses, captures, ...; kept by the partition since it was created or released, not reset here).
    The docs' "Understanding the plan" page lists every key; "Graph bank and memory" explains the rows."""
    from .runtime.release import graph_memory, held_bytes, partition_stats
    partitions = partition_stats()  # first: it counts the steady replays a partition has not counted yet
    with _lock:
        snapshot = copy.deepcopy(_state)
        snapshot.update(_replays())
    snapshot["graphs"] = graph_memory()
    snapshot["graph_bytes"] = held_bytes(snapshot["graphs"])
    snapshot["partitions"] = partitions
    snapshot["reuse"] = reuse(snapshot["partitions"])
    return snapshot


def reuse(partitions: list) -> float:
    """Over partitions' rows (stats()["partitions"]): the share of calls after warmup that a graph captured at an
    earlier call served. What pays for capture: a graph captured and not reused is pure cost."""
    after = sum(p["calls"] - p["warmup_calls"] for p in partitions)
    return round(sum(p["replays"] for p in partitions) / after, 3) if after > 0 else 0.0


def reset_stats() -> None:
    """Zero every counter (does not touch captured graphs)."""
    global _state
    from .runtime.release import partition_stats
    partition_stats()  # the steady replays made before now are counted, then zeroed with the rest
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
    (partition_runner.py)."""
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


def record_max(name: str, key: str, value: float) -> None:
    """Keep the largest value seen per key in a dict counter."""
    with _lock:
        table = _state[name]
        table[key] = max(table.get(key, value), value)

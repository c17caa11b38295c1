"""`cgcompile.stats()` and `cgcompile.reset_stats()`: the process-wide counters (counters.py) and what the live
runtimes report about their graphs and partitions (runtime/release.py)."""

from __future__ import annotations

from typing import Any, Dict

from . import counters
from .runtime.release import graph_memory, held_bytes, memory_by_kind, partition_stats


def stats() -> Dict[str, Any]:
    """A snapshot of the counters since the last reset_stats(), plus `graphs`: one entry per captured graph
    alive now (partition, label, kind, replays, pool_bytes, static_input_bytes, static_output_bytes, and for a
    partition whose sizes vary its output `arena`, `arena_bytes`, `arena_output_bytes`), `graph_bytes`: what they
    hold together (each arena once), `graph_memory`: that total by kind (static inputs copied in, outputs the
    backward reads, other outputs, arenas, pool), and `partitions`: per captured partition its graph-bank accounting (calls,
    replays, misses, captures, ...; kept by the partition since it was created or released, not reset here).
    Rows of `graphs` and `partitions` come frame by frame in compile order; a frame's partitions in its plan's
    order, its graphs in capture order.
    The docs' "Understanding the plan" page lists every key; "Graph bank and memory" explains the rows."""
    partitions = partition_stats()  # first: it counts the steady replays a partition has not counted yet
    snapshot = counters.snapshot()
    snapshot["graphs"] = graph_memory()
    snapshot["graph_bytes"] = held_bytes(snapshot["graphs"])
    snapshot["graph_memory"] = memory_by_kind(snapshot["graphs"])
    snapshot["partitions"] = partitions
    snapshot["reuse"] = counters.reuse(partitions)
    return snapshot


def reset_stats() -> None:
    """Zero every counter (does not touch captured graphs)."""
    partition_stats()  # the steady replays made before now are counted, then zeroed with the rest
    counters.reset()

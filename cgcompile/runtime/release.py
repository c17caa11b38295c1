"""cgcompile.release(): drop every CUDA graph, pool and side stream the backend holds, now.

Why explicit: a captured graph is destroyed only when the last Python reference to it goes, and references
outlive a model in ways a user cannot see (Dynamo's caches, autograd graphs of kept outputs, aliases a replay
handed out). Graphs with NCCL collectives keep the communicator busy, so `dist.destroy_process_group()`
waits for them. release() resets every graph itself instead of waiting for the garbage collector.
Compiled models stay usable: their next calls warm up and capture again. `torch._dynamo.reset()` calls it
too, through the backend's `reset` attribute (torch.compile's backend wrapper calls it on Dynamo reset).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List

import torch

__all__ = ["graph_memory", "held_bytes", "holders", "register", "release"]

# objects with release() (and maybe graph_memory()), in the order registered: stats() and graph_memory() list
# their rows in that order (a WeakSet's order follows addresses, which change from run to run)
_holders: "weakref.WeakKeyDictionary[Any, None]" = weakref.WeakKeyDictionary()


def register(holder: Any) -> Any:
    """Track an object that holds graphs (ModelRuntime, CapturedStep, TEFrame) for release()."""
    _holders[holder] = None
    return holder


def holders() -> List[Any]:
    """The objects registered and still alive."""
    return list(_holders)


def release() -> None:
    """Reset every captured graph, forget every pool and side stream, and return the memory to CUDA."""
    for holder in list(_holders):
        holder.release()
    from .drivers.cuda import release_cuda_graphs
    release_cuda_graphs()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def partition_stats() -> List[Dict[str, Any]]:
    """One entry per captured partition that ran since its runtime was created or released: its graph-bank
    accounting (see ModelRuntime.partition_stats)."""
    return [row for holder in list(_holders) for row in getattr(holder, "partition_stats", list)()]


def graph_memory() -> List[Dict[str, Any]]:
    """One entry per live captured graph: partition, kind, and the bytes it holds (see ModelRuntime)."""
    rows: List[Dict[str, Any]] = []
    for holder in list(_holders):
        describe = getattr(holder, "graph_memory", None)
        if describe is not None:
            rows.extend(describe())
    return rows


def held_bytes(rows: List[Dict[str, Any]]) -> int:
    """Bytes the graphs of `rows` (graph_memory()) hold together: each graph's pool, input buffers and own
    outputs, and each output arena once however many graphs share it."""
    arenas = {row["arena"]: row["arena_bytes"] for row in rows if row.get("arena")}
    return sum(row["pool_bytes"] + row["static_input_bytes"] + row["static_output_bytes"] for row in rows) + sum(
        arenas.values())


def memory_by_kind(rows: List[Dict[str, Any]]) -> Dict[str, int]:
    """What the graphs of `rows` (graph_memory()) hold, by kind: input buffers copied in; forward outputs the
    backward reads (eager holds those too, between forward and backward); gradients, the backward graphs' outputs
    (eager holds those as .grad too; stolen ones are .grad); other outputs kept as static memory (what eager would
    free once read); output arenas (each once); the pool reserved at capture (CUDA); and the total (held_bytes)."""
    arenas = {row["arena"]: row["arena_bytes"] for row in rows if row.get("arena")}
    saved = sum(row.get("saved_output_bytes", 0) for row in rows)
    gradients = sum(row["static_output_bytes"] for row in rows if row["kind"] == "backward")
    return {"static_inputs": sum(row["static_input_bytes"] for row in rows), "saved_for_backward": saved,
            "gradients": gradients,
            "other_outputs": sum(row["static_output_bytes"] for row in rows if row["kind"] != "backward") - saved,
            "arenas": sum(arenas.values()), "pool": sum(row["pool_bytes"] for row in rows),
            "total": held_bytes(rows)}

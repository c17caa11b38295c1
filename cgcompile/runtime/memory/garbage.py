"""Reference cycles that hold graph memory: collected before the runtime acts on a graph looking held.

A graph is held while anything references its memory (claim.py), garbage included: an output kept by an object
in a reference cycle (an autograd context that stores an output as an attribute, in the graph of a step already
done) stays referenced until Python's cyclic collector runs, and for objects that lived through a step (promoted
to the oldest generation) that can be many steps later, at a moment set by everything else the process did. A
call that finds every instance held captures another one, and the held one may never run again: the graphs kept
would depend on the collector's schedule (an HF Mixtral loop without warmup kept 16 graphs alone and 20 after
other work in the same process). So before such a call keeps its decision, one full collection runs and the
instances are looked at again, as torch's CUDA graph trees collect before trusting a check of live storages. What
the garbage held is learnt as from any holder (runtime/local/family.py: those outputs are handed out as copies from
then on), so the garbage of later steps holds copies, not graphs, and needs no collection.

Bounded, since a full collection costs as much as a capture in a large process: only a forward or inference
instance whose backward is not pending can be held by garbage alone (a pending backward means autograd still
needs it, as in fwd, fwd, bwd, bwd; grads a backward graph hands out are held by `.grad`), and a collection that
freed none of the graphs that blocked the call is not repeated until a graph is captured or released
(memory_changed), so a loop that really holds its graphs pays one collection, not one per call.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Sequence

__all__ = ["CycleCollector"]

log = logging.getLogger("cgcompile")


class CycleCollector:
    """When to run a full garbage collection for graphs that look held (`collect_for`), for one runtime."""

    def __init__(self) -> None:
        self.futile = False  # the last collection freed none of its graphs, and no graph came or went since

    def memory_changed(self) -> None:
        """A graph was captured or released: what holds graph memory may have changed."""
        self.futile = False

    def collect_for(self, blockers: Sequence[Any]) -> bool:
        """`blockers` (graphs with held()) stop a call from replaying: collect reference cycles, when garbage may
        hold one of them and the last collection was not futile. True when one of them is free now (the caller
        looks at its instances again)."""
        if self.futile or not any(_garbage_may_hold(graph) for graph in blockers):
            return False
        gc.collect()
        freed = [graph for graph in blockers if not graph.held()]
        self.futile = not freed
        if freed:
            log.debug("cgcompile: a garbage collection freed %d graph(s) held only by reference cycles (%s)",
                      len(freed), freed[0].label)
        return bool(freed)


def _garbage_may_hold(graph: Any) -> bool:
    """Could garbage alone hold `graph`: a forward or inference instance, its backward not pending?"""
    return graph.kind != "backward" and not graph.pending_backward

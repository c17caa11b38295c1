"""The memory registry of one compiled frame: which captured graph owns which memory, and the pool rule.

Every graph a ModelRuntime (runtime/local/model_runtime.py) captures goes into one memory pool, in capture order, so
a graph's temporaries reuse memory other graphs freed and the runtime pays for one pool's segments, not one per
graph. Sharing is safe only if a graph never replays while memory it may scribble over is still needed: its
temporaries may overlap the static memory of graphs captured *after* it. So a graph replays only when no graph
captured after it is held (the pool rule); otherwise the call takes another instance (a steady loop replays in
capture order, so this only adds instances where a later graph's outputs outlive the next call, as in fwd, fwd,
bwd, bwd). The rule is tracked incrementally: graphs replayed since last found free are kept in capture order
(`_in_flight`), and a check looks only at those after the graph, dropping each it finds free (a graph stays free
until its next replay), so a steady loop pays O(1) per replay whatever the depth. The emulate driver models the
pool (a replay poisons the outputs of the graphs captured after it), so a wrong rule fails the CPU tests.

`changes` counts every event that can make memory held or change the pool (a replay, a capture, a discard): while
it stands still, a replay that was allowed and handed nothing of its graph's memory out is allowed again (the
compiled steady replay, runtime/local/steady.py, relies on it instead of asking the claims and the pool rule).

Owners are what makes an input *borrowed* and a graph *held* (runtime/local/instance.py): a storage address maps to
the graph (or output arena, arena.py) owning it. Graphs are duck-typed here (claim_owned, borrow, settle, forget,
held, arena, pool_position): the registry records and looks up, each graph keeps its own claims.
"""

from __future__ import annotations

import bisect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ... import _compat
from ..tensors import inner_tensors, storage_ptr

__all__ = ["MemoryRegistry"]


class MemoryRegistry:
    """Owners of static memory by storage address, and the graphs in pool (capture) order."""

    def __init__(self) -> None:
        self._owners: Dict[int, Any] = {}  # storage data_ptr -> graph (or output arena) owning that memory
        self._pooled: List[Optional[Any]] = []  # graphs in capture order (None: discarded)
        self._in_flight: List[int] = []  # sorted pool positions of graphs replayed and not found free since
        # Bumped by every event that can make memory held or change the pool (a replay, a capture, a discard): a
        # steady replay that handed nothing out stays allowed while it is unchanged (runtime/local/steady.py)
        self.changes = 0

    def clear(self) -> None:
        self._owners.clear()
        self._pooled, self._in_flight = [], []
        self.changes += 1

    def owns(self, t: Any) -> bool:
        """Does `t` alias memory owned by one of our graphs (a static output or a static input buffer)? A wrapper
        (DTensor) does when one of its inner tensors does."""
        return isinstance(t, torch.Tensor) and bool(self._owners) and any(
            storage_ptr(inner) in self._owners for inner in inner_tensors(t))

    def any_owned(self) -> bool:
        return bool(self._owners)

    def owner(self, t: torch.Tensor) -> Any:
        """The graph or output arena owning t's memory, or None."""
        return self._owners.get(storage_ptr(t)) if self._owners else None

    def lenders(self, args: Sequence[Any]) -> Dict[int, Tuple[Any, int, int]]:
        """For the arguments living in our graphs' memory: storage ptr -> (owner's claim, handle, use count now)."""
        found: Dict[int, Tuple[Any, int, int]] = {}
        for arg in args:
            if isinstance(arg, torch.Tensor) and self._owners:
                ptr, sid = _compat.storage_key(arg)
                if ptr in self._owners and ptr not in found:
                    found[ptr] = (self._owners[ptr].claim, sid, _compat.storage_use_count(sid))
        return found

    def register(self, graph: Any, lenders: Dict[int, Tuple[Any, int, int]]) -> None:
        """Record a new graph's memory: what it owns (it claims it, with use-count baselines), what it borrows,
        and the output arena it writes into (which owns that memory, arena.py); its place in the pool.

        `lenders` was measured before the capture with the same caller references alive, so the growth of each
        lender's use count is exactly the references the new graph keeps (its held inputs, outputs that view
        them, and anything those keep alive) and goes into the lender's idle baseline."""
        for ptr in graph.claim_owned():
            self._owners[ptr] = graph
        arena = graph.arena
        if arena is not None:
            for ptr in arena.claim.storages:
                self._owners[ptr] = arena
        for ptr, (lender, sid, before) in lenders.items():
            if ptr in lender.storages:
                graph.borrow(lender, ptr, _compat.storage_use_count(sid) - before)
        graph.settle(len(self._pooled))
        self._pooled.append(graph)
        self.changes += 1

    def discard(self, graph: Any) -> Optional[Any]:
        """Forget a graph's memory (re-capture, fallback, release) so its storage can be freed; its output arena's
        too when it was the last member. Returns the backward graph that belonged to it, to forget next."""
        self.changes += 1
        for ptr in graph.claim.storages:
            if self._owners.get(ptr) is graph:
                del self._owners[ptr]
        if graph.pool_position is not None:
            self._pooled[graph.pool_position] = None
        arena = graph.arena
        backward = graph.forget()
        if arena is not None and not arena.alive:  # its last member: the arena's memory goes with it
            for ptr in arena.claim.storages:
                if self._owners.get(ptr) is arena:
                    del self._owners[ptr]
        return backward

    def pool_blocker(self, graph: Any) -> Optional[Any]:
        """The pool rule (module docstring): a graph captured after `graph` that is held (its replay would be overwritten), or None. Looks only at
        graphs replayed since last found free, latest first, and forgets each found free."""
        in_flight, position = self._in_flight, graph.pool_position
        while in_flight and in_flight[-1] > position:
            later = self._pooled[in_flight[-1]]
            if later is not None and later.held():
                return later
            in_flight.pop()
        return None

    def mark_in_flight(self, graph: Any) -> None:
        """A graph replayed: it is in flight until found free."""
        self.changes += 1
        position = graph.pool_position
        in_flight = self._in_flight
        if not in_flight or in_flight[-1] < position:
            in_flight.append(position)
        elif in_flight[-1] != position:
            index = bisect.bisect_left(in_flight, position)
            if index == len(in_flight) or in_flight[index] != position:
                in_flight.insert(index, position)

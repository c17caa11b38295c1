"""Output arenas: memory shared by the graphs one partition captures for different input sizes.

Why: a partition whose input sizes vary (a dynamic batch, `capture_sizes`, `dynamic_padding="buckets"`, rows
selected before a graph break) keeps one graph per size, and every captured graph keeps its static outputs
alive between calls, so memory would grow with the number of sizes kept. Graphs of one partition for different
sizes are rarely in flight at the same time, so they write their outputs into one *arena*: one block of
memory per output position, as large as the largest size needs. Memory then follows the largest size, not
the number of sizes.

How (runtime/local/instance.py, runtime/local/family.py and runtime/local/runner.py apply it; this module keeps the arenas and their rules):
- Members: forward, backward or inference graphs of one partition, one kind and one parameter set, at most one
  per input signature. Each writes its fresh outputs into arena views with the output's own shape and strides
  (a device copy inside the graph; its own result is then a temporary) and hands out views of the arena. The
  arena's views are static inputs of the graph, so the emulate driver sees capture leave them untouched, as a
  real capture does.
- An arena is *held* while anything beyond its members and the graphs that borrow its memory references it
  (an output alias alive or saved for backward, a view the caller kept, stolen grads; runtime/memory/claim.py). A member
  replays only when its arena is free; otherwise the call takes another instance, in another arena (fwd, fwd,
  bwd, bwd with two sizes gives two arenas), exactly as for a held graph.
- Pool: members capture into the runtime's one pool like every graph, so the pool rule (runtime/local/model_runtime.py) keeps a
  member from replaying while a graph captured after it is held; and no member replays while another member is
  held, even with memory of its own (an output that could not move, an input buffer).
- Capacity: a new size that fits no idle arena gets a new one, as large per position as the largest arena of
  its group, the size needs, or the sizes known to come need (the largest each position took in the eager
  warmup runs of every size so far, and for declared `capture_sizes` the largest declared size), whichever is
  more. Arenas smaller than that are then *superseded*: once idle,
  their members are released and their sizes capture again into a full-size arena at their next call (one
  capture each time the largest size grows; sizes that repeat stop growing it soon). So a group holds one
  full-size arena per graph in flight at a time, whatever the number of sizes. An arena goes away with its
  last member (the bank policy also releases members that stop paying).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ... import _compat
from ..drivers.base import CaptureError
from ..tensors import copy_into
from .claim import MemoryClaim

__all__ = ["ArenaGroup", "OutputArena", "OutputLayout", "arena_capacity", "largest_capacity", "output_layouts",
           "span_bytes", "superseded", "writing_into"]

# (dtype, shape, strides, bytes spanned) of one output that can live in an arena; None for one that cannot
OutputLayout = Optional[Tuple[torch.dtype, Tuple[int, ...], Tuple[int, ...], int]]

_serial = itertools.count(1)


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from t's first element to its last, in t's own strides (storage offset left out)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def output_layouts(outputs: Sequence[Any], inputs: Sequence[Any], device: torch.device) -> List[OutputLayout]:
    """Per output of a graph run on `inputs`: its layout if it may live in an arena, else None.

    Only fresh memory on the runtime's `device` moves: an output sharing storage with an input (a view or
    in-place result) or with another output (aliases aot relies on) stays where the graph puts it, as do empty
    outputs, outputs on another device and non-tensors."""
    taken = {_compat.storage_key(t)[0] for t in inputs if isinstance(t, torch.Tensor)}
    counts: Dict[int, int] = {}
    for out in outputs:
        if isinstance(out, torch.Tensor):
            ptr = _compat.storage_key(out)[0]
            counts[ptr] = counts.get(ptr, 0) + 1
    layouts: List[OutputLayout] = []
    for out in outputs:
        ptr = _compat.storage_key(out)[0] if isinstance(out, torch.Tensor) else 0
        if not ptr or ptr in taken or counts[ptr] > 1 or span_bytes(out) == 0 or not _on(device, out):
            layouts.append(None)
        else:
            layouts.append((out.dtype, tuple(out.shape), tuple(out.stride()), span_bytes(out)))
    return layouts


def _on(device: torch.device, t: torch.Tensor) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def arena_capacity(needs: Dict[int, int], largest: Dict[int, int]) -> Dict[int, int]:
    """Bytes per output position for a new arena of a group whose arenas hold at most `largest` there: enough
    for this size and for every size the group has seen, so any of them can move into it."""
    return {j: max(needs.get(j, 0), largest.get(j, 0)) for j in sorted(set(needs) | set(largest))}


def largest_capacity(capacities: Sequence[Dict[int, int]]) -> Dict[int, int]:
    """Per output position, the most bytes any of these arenas (given by their bytes per position) holds."""
    largest: Dict[int, int] = {}
    for capacity in capacities:
        for j, n in capacity.items():
            largest[j] = max(largest.get(j, 0), n)
    return largest


def superseded(capacities: Sequence[Dict[int, int]]) -> List[int]:
    """Indices of the arenas (given by their bytes per position) smaller somewhere than the group's largest
    per position: their sizes fit a full-size arena, where they move once idle."""
    largest = largest_capacity(capacities)
    return [i for i, capacity in enumerate(capacities) if any(capacity.get(j, 0) < n for j, n in largest.items())]


class OutputArena:
    """One block of memory per output position, shared by graphs of one partition that are never in flight
    together. Registered with the runtime as the owner of its memory (inputs living there are borrowed, frame
    outputs there are cloned), like a graph's own static outputs."""

    def __init__(self, capacity: Dict[int, int], device: torch.device, name: str):
        self.name = f"arena {next(_serial)} of {name}"
        self.blocks = {j: torch.empty(n, dtype=torch.uint8, device=device) for j, n in capacity.items() if n}
        self.claim = MemoryClaim()  # its blocks; borrowers and members add the references they keep
        for block in self.blocks.values():
            self.claim.own(*_compat.storage_key(block))
        self.claim.settle()
        self.members: Dict[Any, Tuple[Any, Dict[int, int]]] = {}  # family -> (graph, references it keeps)
        self.family = None  # an arena belongs to no graph family: a blocking arena teaches no family what is held

    @property
    def alive(self) -> bool:
        return bool(self.members)

    @property
    def nbytes(self) -> int:
        return sum(block.numel() for block in self.blocks.values())

    def capacity(self) -> Dict[int, int]:
        return {j: block.numel() for j, block in self.blocks.items()}

    def member_graphs(self) -> List[Any]:
        return [graph for graph, _ in self.members.values()]

    def fits(self, needs: Dict[int, int]) -> bool:
        return all(j in self.blocks and self.blocks[j].numel() >= n for j, n in needs.items())

    def views(self, layouts: Sequence[OutputLayout]) -> List[Tuple[int, torch.Tensor]]:
        """(output position, a tensor on the arena's block with that output's dtype, shape and strides)."""
        found = []
        for j, layout in enumerate(layouts):
            if layout is not None:
                dtype, shape, stride, _ = layout
                view = torch.empty(0, dtype=dtype, device=self.blocks[j].device)
                view.set_(self.blocks[j].untyped_storage(), 0, shape, stride)
                found.append((j, view))
        return found

    def join(self, family: Any, graph: Any, before: Dict[int, int]) -> None:
        """`graph` (captured for `family`'s size) now writes here; what its capture added to the use counts since
        `before` are references it keeps while idle."""
        kept = {ptr: count - before[ptr] for ptr, count in self.claim.use_counts().items()}
        for ptr, extra in kept.items():
            self.claim.keep(ptr, extra)
        self.members[family] = (graph, kept)

    def leave(self, graph: Any) -> None:
        """A member was discarded: its references no longer count as idle ones."""
        for family, (member, kept) in list(self.members.items()):
            if member is graph:
                for ptr, extra in kept.items():
                    self.claim.keep(ptr, -extra)
                del self.members[family]

    def has_member_for(self, family: Any) -> bool:
        return family in self.members

    def replayed(self) -> None:
        """A member wrote the blocks: their users must be found free again."""
        self.claim.replayed()

    def held(self) -> bool:
        """Does anything beyond members and borrowers reference the arena's memory, or is a member held on its own
        (the pool rule's hazard within the arena)?"""
        return self.claim.held() or any(graph.claim.held() for graph, _ in self.members.values())


class ArenaGroup:
    """The arenas of one partition, graph kind and parameter set: where the next captured size writes."""

    def __init__(self, name: str):
        self.name = name
        self._arenas: List[weakref.ref] = []  # members keep an arena alive; an arena without members goes

    def arenas(self) -> List[OutputArena]:
        found = [ref() for ref in self._arenas]
        self._arenas = [ref for ref, arena in zip(self._arenas, found) if arena is not None and arena.alive]
        return [arena for arena in found if arena is not None and arena.alive]

    def place(self, family: Any, layouts: Sequence[OutputLayout], device: torch.device,
              reserve: Dict[int, int]) -> Optional[OutputArena]:
        """The arena a new graph of `family` (one input signature) writes its outputs into: a free full-size one
        without a graph of this signature yet, else a new full-size one (arena_capacity), holding at least
        `reserve` bytes per position (sizes known to come)."""
        needs = {j: layout[3] for j, layout in enumerate(layouts) if layout is not None}
        if not needs:
            return None
        arenas = self.arenas()
        capacities = [a.capacity() for a in arenas]
        small = set(superseded(capacities))
        for index, arena in enumerate(arenas):
            if index not in small and arena.fits(needs) and not arena.has_member_for(family) and not arena.held():
                return arena
        wanted = {j: max(n, reserve.get(j, 0)) for j, n in needs.items()}
        arena = OutputArena(arena_capacity(wanted, largest_capacity(capacities)), device, self.name)
        self._arenas.append(weakref.ref(arena))
        return arena

    def superseded_free(self) -> List[OutputArena]:
        """Arenas smaller than the group's largest whose members may move now (free): the runner releases them."""
        arenas = self.arenas()
        return [arenas[i] for i in superseded([a.capacity() for a in arenas]) if not arenas[i].held()]


def writing_into(run: Any, arena_positions: Sequence[int], first: int) -> Any:
    """`run` (a graph's callable over a list of inputs) changed to write output `arena_positions[k]` into its
    input `first + k` (an arena view) and return that view instead: the copy is part of the captured graph."""
    def run_into_arena(inputs: list) -> List[Any]:
        outputs = list(run(inputs[:first]))
        for k, j in enumerate(arena_positions):
            view, out = inputs[first + k], outputs[j]
            if (not isinstance(out, torch.Tensor) or out.dtype != view.dtype or out.shape != view.shape
                    or out.stride() != view.stride()):
                raise CaptureError(f"output {j} changed layout between runs of one input signature")
            copy_into(view, out)
            outputs[j] = view
        return outputs

    return run_into_arena

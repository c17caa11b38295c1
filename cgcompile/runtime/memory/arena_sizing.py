"""One partition's output arenas and how large they are made (arena.py has the arenas themselves).

A partition whose input sizes vary writes the outputs of its graphs of one kind and parameter set into shared
output arenas; an arena made too small is superseded by a larger one and its graphs captured again, so each is
sized at its first capture for the most it will need: the most bytes each output position took in the warmup runs
so far, and with declared `capture_sizes` the layouts grown to the largest declared size.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from .arena import ArenaGroup

__all__ = ["ArenaSizing"]


class ArenaSizing:
    """The arena groups of one partition (per graph kind and parameter set) and what their arenas hold at least.

    `label` names the partition in arena names; `param_set_number(param_storages)` numbers a parameter set as the
    partition's graph labels do; `batch_at` is the (input, dim) holding the batch capture_sizes pads (else None)."""

    def __init__(self, label: str, capture_sizes: Sequence[int], batch_at: Optional[Tuple[int, int]],
                 param_set_number: Callable[[frozenset], int]):
        self.label = label
        self.batch_at = batch_at
        self.largest_batch = max(capture_sizes) if capture_sizes else 0  # the largest declared size
        self.param_set_number = param_set_number
        self.groups: Dict[Tuple[str, frozenset], ArenaGroup] = {}
        self.largest_outputs: Dict[str, Dict[int, int]] = {}  # per kind and output position, the most bytes seen

    def group(self, kind: str, param_storages: frozenset) -> ArenaGroup:
        """The output arenas of the partition's `kind` graphs for one parameter set."""
        key = (kind, param_storages)
        if key not in self.groups:
            self.groups[key] = ArenaGroup(f"{self.label} params {self.param_set_number(param_storages)} {kind}")
        return self.groups[key]

    def forget_groups(self) -> None:
        """The partition released every graph: its arenas go with them."""
        self.groups = {}

    def note_layouts(self, kind: str, layouts: Sequence[Any]) -> None:
        """An eager run of a `kind` graph had these output layouts (arena.output_layouts): remember per position
        the most bytes any size took."""
        largest = self.largest_outputs.setdefault(kind, {})
        for j, layout in enumerate(layouts):
            if layout is not None:
                largest[j] = max(largest.get(j, 0), layout[3])

    def batch_of(self, args: Sequence[Any]) -> Optional[int]:
        """The batch this call's arguments hold, when capture_sizes pads it; else None."""
        if self.batch_at is None or not self.largest_batch:
            return None
        index, dim = self.batch_at
        return int(args[index].shape[dim])

    def reserve(self, kind: str, layouts: Optional[Sequence[Any]], batch: Optional[int]) -> Dict[int, int]:
        """Bytes per output position a new arena for `kind` graphs holds at least: the most any size took in
        warmup runs, and for declared capture sizes the layouts of `batch` grown to the largest size (each dim equal
        to the batch taken as the batch: exact for row-wise outputs, more than needed where a dim merely equals
        it). A size that still needs more later supersedes the arena (arena.py)."""
        reserve = dict(self.largest_outputs.get(kind, {}))
        if batch and layouts is not None and self.largest_batch > batch:
            for j, layout in enumerate(layouts):
                if layout is not None:
                    grow = (self.largest_batch / batch) ** sum(n == batch for n in layout[1])
                    reserve[j] = max(reserve.get(j, 0), int(layout[3] * grow))
        return reserve

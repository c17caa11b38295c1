"""The CUDA-graph memory pool as the CPU emulations model it (the emulate driver, emulate.py, and the emulation of
make_graphed_callables, runtime/frame/te_emulation.py): what memory holds after a capture, and which graphs' memory
a replay overwrites.

A capture runs no kernel, so its outputs hold garbage until a replay; graphs captured into one pool share it in
capture order, so a replay's temporaries may lie where any graph captured after it keeps its outputs. Garbage is
NaN (or the dtype's max, or True), so a test that reads memory a GPU would have overwritten fails.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any, List, Optional, Sequence

import torch

from ..tensors import broadcast_core

__all__ = ["EmulatedPool", "PoolSlot", "poison"]


def poison(tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """Fill tensors with garbage: what memory holds after a capture or after another graph's replay wrote over it."""
    with torch.no_grad():
        for out in tensors:
            if out is None or out.numel() == 0:
                continue
            out = broadcast_core(out)  # an expanded output: each element once
            if out.is_floating_point() or out.is_complex():
                out.fill_(float("nan"))
            elif out.dtype == torch.bool:
                out.fill_(True)
            else:
                try:
                    out.fill_(torch.iinfo(out.dtype).max)
                except (TypeError, RuntimeError):  # exotic dtypes: leave as computed
                    pass


class PoolSlot:
    """Memory one graph keeps in a pool (`pool_memory`), for an emulation whose graphs are not objects of their own."""

    __slots__ = ("pool_memory", "__weakref__")

    def __init__(self, pool_memory: List[Optional[torch.Tensor]]):
        self.pool_memory = pool_memory


class EmulatedPool:
    """The graphs captured into one pool (anything with a `pool_memory` list), in capture order, and which of them
    hold valid outputs now."""

    def __init__(self) -> None:
        self.graphs: List[weakref.ref] = []
        self.valid: List[int] = []  # sorted capture positions of graphs replayed since last overwritten

    def add(self, graph: Any) -> int:
        self.graphs.append(weakref.ref(graph))
        return len(self.graphs) - 1

    def replayed(self, position: int) -> None:
        """The graph at `position` ran: its temporaries overwrote every later graph's memory."""
        valid = self.valid
        while valid and valid[-1] > position:
            graph = self.graphs[valid.pop()]()
            if graph is not None:
                poison(graph.pool_memory)
        if not valid or valid[-1] != position:
            bisect.insort(valid, position)

"""Why a captured graph (runtime/local/instance.py) no longer serves a call whose addresses do not match it: one of
its own parameters moved (captured again), or only its in-place inputs did (copied in and back from then on,
runtime/local/family.py), rather than the call passing another layer's parameters."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

__all__ = ["in_place_moved", "moved"]


def in_place_moved(graph: Any, args: Sequence[Any]) -> List[int]:
    """The in-place inputs this call passes at other addresses, when its parameters and borrowed inputs are where
    `graph` reads them (so only those inputs stop it from replaying)."""
    inputs = graph.captured.static_inputs
    moved_inputs = [i for i in graph.in_place if args[i].data_ptr() != inputs[i].data_ptr()]
    check = graph.addresses
    others = [(i, p) for i, p in zip(check.indices, check.ptrs) if i not in graph.in_place]
    if moved_inputs and all(args[i].data_ptr() == p for i, p in others):
        return moved_inputs
    return []


def moved(graph: Any, args: Sequence[Any]) -> Optional[str]:
    """Why `graph` is stale for `args`, if one of its own parameter objects is passed at another address (else the
    call passes other parameters, e.g. another layer's)."""
    inputs = graph.captured.static_inputs
    for i, ref in graph.param_refs.items():
        if ref() is args[i] and args[i].data_ptr() != inputs[i].data_ptr():
            return f"static input {i} moved (parameter or buffer re-allocated)"
    return None

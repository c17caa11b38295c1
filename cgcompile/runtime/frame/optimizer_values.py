"""The Python numbers a captured training step reads from its optimizers (lr, momentum, betas, ...).

A CUDA graph replays its kernels with the arguments they had at capture: an optimizer's `lr` given as a Python
float is such an argument, so a scheduler that changes it after capture would be ignored on every replay
(silently wrong training). capture_step snapshots these values at capture and compares them before each replay
(a few dict reads); a change means capturing again, or running eagerly when the values change too often to pay
for captures. A value given as a tensor that the optimizer reads on the device (AdamW's `lr=torch.tensor(...)` with
capturable=True; torch's schedulers update it in place) is read by the graph at replay and left out. A value given as a tensor (`lr=torch.tensor(0.01)`, which torch's schedulers update in place) is
read by the graph at replay and is left out of the snapshot.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

import torch

__all__ = ["OptimizerValues", "changed_value"]

_PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
    """A Python value a kernel would take as an argument (tensors are read at replay instead)."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


class OptimizerValues:
    """The optimizers a step calls `.step()` on (seen during an eager run), and their plain hyperparameters."""

    def __init__(self) -> None:
        self._optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._order: List[weakref.ref] = []

    def saw_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer step pre-hook's callback: remember the optimizer."""
        if optimizer not in self._optimizers:
            self._optimizers.add(optimizer)
            self._order.append(weakref.ref(optimizer))

    def snapshot(self) -> Tuple[Tuple[str, Any], ...]:
        """(where, value) for every plain hyperparameter of every param group, in a stable order."""
        found = []
        for ref in self._order:
            optimizer = ref()
            if optimizer is None:
                continue
            name = type(optimizer).__name__
            for index, group in enumerate(optimizer.param_groups):
                for key in sorted(group):
                    if key != "params" and _plain(group[key]):
                        found.append((f"{name} param group {index} {key!r}", group[key]))
        return tuple(found)


def changed_value(before: Tuple[Tuple[str, Any], ...], now: Tuple[Tuple[str, Any], ...]) -> Optional[str]:
    """The first hyperparameter that differs between two snapshots, as "where: old -> new"; None if none."""
    if before == now:
        return None
    old = dict(before)
    for where, value in now:
        if where not in old or old[where] != value:
            return f"{where}: {old.get(where)!r} -> {value!r}"
    return "the optimizers' hyperparameters changed"

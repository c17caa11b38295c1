"""Option `verify=N`: run each captured partition's eager code beside it for its first N calls after warmup
(the first replays) and report the largest difference, so a user can check a capture on their own model before trusting it.

The eager reference runs under no_grad on copies of the inputs (a partition may mutate its inputs), from the
random state the captured call started with, which is put back afterwards: both draw the same numbers, and the
stream goes on as if only the captured call had run.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ... import _compat, counters
from ..drivers.thread_state import RngState, preserved_global_state

log = logging.getLogger("cgcompile")


def _max_difference(got: Any, expected: Any) -> float:
    got_flat, _ = _compat.tree_flatten(got)
    expected_flat, _ = _compat.tree_flatten(expected)
    worst = 0.0
    for a, b in zip(got_flat, expected_flat):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
            if a.is_floating_point() or a.is_complex():
                worst = max(worst, (a.detach() - b).abs().max().item() if a.numel() else 0.0)
            elif not torch.equal(a.detach(), b):
                worst = float("inf")
    return worst


class VerifiedPartition(torch.nn.Module):
    """Calls the runtime's partition, and for `steps` calls after the `skip` warmup calls also the eager
    submodule."""

    def __init__(self, runtime_fn: Callable[..., Any], submod: torch.nn.Module, name: str, steps: int, skip: int):
        super().__init__()
        self.runtime_fn = runtime_fn
        self.submod = submod
        self.name = name
        self.remaining = steps
        self.skip = skip
        self.calls = 0

    def forward(self, *args: Any) -> Any:
        if self.skip > 0 or self.remaining <= 0:
            self.skip -= 1
            return self.runtime_fn(*args)
        self.remaining -= 1
        self.calls += 1
        copies = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        before = RngState.now()
        out = self.runtime_fn(*args)
        after = RngState.now()
        before.restore()
        with torch.no_grad(), preserved_global_state():
            expected = self.submod(*copies)
        after.restore()
        diff = _max_difference(out, expected)
        counters.record_max("verify_max_diff", self.name, diff)
        log.info("cgcompile verify: %s call %d: max |captured - eager| = %.3g", self.name, self.calls, diff)
        return out

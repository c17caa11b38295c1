"""Timing one partition for the benefit rule, and its verdict (the rule itself: runtime/bank/benefit.py).

Only what must be timed is: the eager warmup calls, and the first REPLAY_SAMPLES replays of each kind after a
capture, through the driver's timer (runtime/drivers/timing.py). While the meter is open the partition's
inference calls take the full path (runtime/local/runner.py makes no steady record), so the steady replay never
checks a clock. The runner asks for the verdict at the start of its next full-path call (`settle`), never inside
a call, and falls back with reason `not_profitable` when the replay does not pay.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Sequence, Set

import torch

from ...counters import record_benefit
from ..bank.benefit import BENEFIT_MARGIN, BenefitMeter
from ..drivers.base import Driver
from ..tensors import storage_ptr

__all__ = ["BenefitProbe", "measures"]

log = logging.getLogger("cgcompile")


def measures(config: Any, driver: Driver) -> bool:
    """Is the benefit rule on? Option measure_benefit: on, off, or auto (on where a GPU measures it, the cuda
    driver, and wherever a memory budget needs the savings to rank partitions). Never without warmup calls:
    nothing eager would be timed, and the steady replay would wait for a verdict that never comes."""
    choice = str(config.measure_benefit)
    if not driver.captures or choice == "off" or config.cuda_graph_warmup_steps == 0:
        return False
    return choice == "on" or driver.name == "cuda" or config.cuda_graph_memory_budget is not None


def _nbytes(values: Sequence[Any], skip: Set[int]) -> int:
    """Bytes of the distinct storages among `values` that are not in `skip` (parameters): what a graph's static
    input buffers and outputs would take, an upper bound (inputs a graph borrows are counted too)."""
    seen: Dict[int, int] = {}
    for value in values:
        if isinstance(value, torch.Tensor):
            ptr = storage_ptr(value)
            if ptr and ptr not in skip:
                seen[ptr] = value.untyped_storage().nbytes()
    return sum(seen.values())


class BenefitProbe:
    """One partition's timings (`meter`, pure) and how they are taken."""

    def __init__(self, name: str, describe: Callable[[], str], config: Any, driver: Driver,
                 statics: Callable[[Sequence[Any]], Set[int]]):
        self.name = name
        self.statics = statics  # a call's parameter storages (PartitionInputs.static_storages)
        self.describe = describe
        self.driver = driver
        self.meter = BenefitMeter(measures(config, driver))
        self.params: Set[int] = set()  # the partition's parameter storages seen: never counted as graph bytes

    def eager(self, kind: str, fn: Callable[[Any], Any], args: list, call_args: Sequence[Any]) -> Any:
        """An eager warmup call of graph `kind`: timed (with the bytes a graph of it would hold) while measuring."""
        if not self.meter.open:
            return fn(args)
        out, seconds = self.driver.timer.measure(fn, args, self.name, f"eager {kind}")
        self.params |= self.statics(call_args)
        self.meter.eager_sample(kind, seconds, _nbytes(list(args) + list(out), self.params))
        return out

    def replay(self, graph: Any, args: Sequence[Any], alias: bool, copied: Set[int] = frozenset()) -> Any:
        """A replay of `graph` after its capture: timed, input copies included, while samples are wanted."""
        if not self.meter.wants_replay(graph.kind):
            return graph.replay(args, alias, copied)
        out, seconds = self.driver.timer.measure(lambda a: graph.replay(a, alias, copied), args, self.name,
                                                 f"replay {graph.kind}")
        self.meter.replay_sample(graph.kind, seconds)
        return out

    def settle(self, calls_per_step: int) -> Optional[str]:
        """At the start of a call: the verdict once every kind of a call is measured. Why the partition should
        run eagerly (`not_profitable`, both times named), or None."""
        meter = self.meter
        kinds = meter.ready()
        if kinds is None:
            return None
        profitable = meter.decide(kinds)
        record_benefit(self.name, meter.as_dict(calls_per_step))
        eager, replay = meter.times
        if profitable:
            log.info("cgcompile: %s: replay %.3f ms vs eager %.3f ms per call (%s): captured", self.describe(),
                     replay * 1e3, eager * 1e3, "+".join(kinds))
            return None
        return (f"not_profitable: its replay takes {replay * 1e3:.3f} ms per call, input copies included, its eager "
                f"call {eager * 1e3:.3f} ms ({'+'.join(kinds)}): not faster by {BENEFIT_MARGIN:.0%}")

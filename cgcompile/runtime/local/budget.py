"""The graph-memory budget (option cuda_graph_memory_budget): what all graphs of a model may hold.

The model is every compiled frame with the same options (one ModelRuntime each). Before a new graph is
captured, the bytes it will hold (its eager calls' input and output storages, parameters left out: an upper
bound, runtime/local/benefit.py) are added to what the model's live graphs hold (stats()["graph_bytes"]). When
that passes the budget, room is made, least worth first (runtime/bank/benefit.py's make_room): the partition's own
idle graphs, fewest replays first (other sizes of it, the bank's least used), then every graph of each partition
saving less time per byte than this one (measured saving, or for one not yet measured its eager time, an upper
bound), which then run eagerly for good (reason `memory_budget`). When even that would not make room nothing is
released and the capture is refused: a partition with no graph runs eagerly for good, one with graphs runs that
call eagerly. Without a budget nothing here runs.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ..bank.benefit import make_room
from ..drivers.base import Driver
from ..release import held_bytes
from .instance import memory_of

__all__ = ["GraphBudget", "check_after_capture", "refuses_capture"]


def _bytes_of(graphs: List[Any]) -> int:
    return held_bytes([memory_of(g) for g in graphs])


class GraphBudget:
    """One compiled frame's side of the model's budget: `limit` in bytes (None: no budget)."""

    def __init__(self, config: Any, driver: Driver):
        budget = config.cuda_graph_memory_budget
        self.config = config
        self.limit: Optional[int] = None if budget is None else (
            int(budget * driver.device_bytes()) if isinstance(budget, float) else int(budget))

    def refuses(self, runner: Any, kind: str, runtimes: List[Any]) -> Optional[str]:
        """Before `runner` captures a graph of `kind`: None when it fits (after releasing what make_room chose),
        else why not (the bytes named)."""
        if self.limit is None:
            return None
        runtimes = [rt for rt in runtimes if rt.config == self.config]
        need = runner.benefit.meter.bytes_needed(kind)
        held = _bytes_of([g for rt in runtimes for g in rt.live_graphs()])
        if held + need <= self.limit:
            return None
        own = sorted((g for g in runtimes_graphs(runtimes, runner) if g.kind != "backward" and not g.held_by_itself()
                      and not (g.bw is not None and g.bw.held_by_itself())), key=lambda g: g.replays)  # idle ones
        worth = _worth(runner, need)
        others = sorted(((r, _worth(r, _bytes_of(runtimes_graphs(runtimes, r)))) for rt in runtimes
                         for r in rt.runners() if r is not runner and r.broken is None
                         and runtimes_graphs(runtimes, r)), key=lambda pair: pair[1])
        candidates: List[Tuple[Any, int]] = [(g, _bytes_of([g] + ([g.bw] if g.bw else []))) for g in own] + [
            (r, _bytes_of(runtimes_graphs(runtimes, r))) for r, w in others if w < worth]
        chosen = make_room(need, held, self.limit, candidates)
        if chosen is None:
            refused = (f"memory_budget: a new {kind} graph would hold about {need} bytes, the model's graphs hold "
                    f"{held} of cuda_graph_memory_budget={self.limit} bytes, and no graph saving less per byte can "
                    f"make room")
            if not runtimes_graphs(runtimes, runner):
                runner.fail(refused)  # nothing captured and nothing fits: eager for good
            return refused
        for victim in chosen:
            if victim in own:
                runner.releaser.release([victim], f"the least used, to make room under cuda_graph_memory_budget="
                                                  f"{self.limit} bytes")
            else:
                why = (f"memory_budget: its graphs ({_bytes_of(runtimes_graphs(runtimes, victim))} bytes) released to "
                       f"make room for {runner.name}, which saves more per byte, under "
                       f"cuda_graph_memory_budget={self.limit} bytes")
                if victim.runtime is runner.runtime:
                    victim.fail(why)
                else:  # another frame's: not while another thread calls it (then check_after_capture decides)
                    victim.runtime.when_idle(lambda victim=victim, why=why: victim.fail(why))
        return None


def check_after_capture(budget: GraphBudget, runner: Any, runtimes: List[Any]) -> None:
    """After `runner` captured a graph: its real bytes may pass the estimate (on CUDA the pool holds the graph's
    temporaries too); past the budget the partition runs eagerly for good, its graphs released, so the model's
    graphs hold no more than the budget once the call that captured returns."""
    if budget.limit is None:
        return
    runtimes = [rt for rt in runtimes if rt.config == budget.config]
    held = _bytes_of([g for rt in runtimes for g in rt.live_graphs()])
    if held > budget.limit:
        mine = _bytes_of(runtimes_graphs(runtimes, runner))
        runner.fail(f"memory_budget: its graphs hold {mine} bytes once captured, more than estimated, and the model's "
                    f"graphs {held} bytes, over cuda_graph_memory_budget={budget.limit} bytes")


def refuses_capture(runner: Any, param_set: int, kind: str) -> bool:
    """Must this call of `runner` run eagerly instead of capturing another forward/inference instance? True past
    max_graphs_per_partition or the memory budget (a partition with no graph then runs eagerly for good, the
    budget fails it); counted, the reason kept in stats()["eager_fallbacks"]."""
    refused = runner.ledger.no_room(param_set) or runner.runtime.budget_refuses(runner, kind)
    if refused is not None:
        runner.ran_eagerly(None if runner.broken else refused)
    return refused is not None


def runtimes_graphs(runtimes: List[Any], runner: Any) -> List[Any]:
    """`runner`'s live graphs (every kind)."""
    return [g for rt in runtimes for g in rt.live_graphs() if g.family.part is runner]


def _worth(runner: Any, nbytes: int) -> float:
    """Seconds saved per step per byte: measured, else the eager time (what a replay could save at most)."""
    meter = runner.benefit.meter
    saving = meter.saving()
    per_call = meter.eager_estimate() if saving is None else saving
    return per_call * max(1, len(runner.ledger.param_sets)) / max(1, nbytes)

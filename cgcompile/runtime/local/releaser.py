"""Carrying out the graph-bank ledger's decisions for one partition (runtime/bank/ledger.py decides): releasing
graphs with their memory, sweeping a layer's stale graphs, judging new ones, stopping capture of new sizes.

The partition runner (runtime/local/runner.py) calls it after each forward/inference call and at a steady replay
where the policy is due; its graph families when a larger size supersedes an arena; the frame's runtime when a
parameter a graph reads was freed.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from ...counters import add as count, record
from ..bank import policy as bank_policy
from ..bank.ledger import BankLedger
from ..memory.arena import ArenaGroup
from .instance import GraphInstance

__all__ = ["GraphReleaser"]

log = logging.getLogger("cgcompile")


class GraphReleaser:
    """Releases one partition's graphs as its ledger decides. `bank` is the partition's (graph-bank key ->
    BankEntry), read here; `runtime` gives the memory back."""

    def __init__(self, name: str, describe: Callable[[], str], bank: Dict[Any, Any], ledger: BankLedger,
                 runtime: Any, growth: Callable[[], Optional[Tuple[str, str]]]):
        self.name = name
        self.describe = describe
        self.growth = growth  # what changed at every new size, if one thing did (size_trend.what_changed), for stop()
        self.bank = bank
        self.ledger = ledger
        self.runtime = runtime
        self._logged = False  # the partition's first release is logged; later ones are counted

    def after_call(self, param_set: int) -> None:
        """After a forward/inference call: judge the graphs of its parameter set old enough, release the stale."""
        ledger = self.ledger
        state = ledger.param_sets.get(param_set)
        if state is None:
            return
        if state.unjudged:
            wasted, stop = ledger.judge(param_set)
            self.release(wasted, f"not run again within {bank_policy.JUDGE_AFTER} calls of its layer per graph of "
                                 f"it after its capture")
            if stop is not None:
                self.stop(stop)
        if state.calls >= state.next_sweep:
            self.sweep(param_set)

    def sweep(self, param_set: int) -> None:
        """Release this parameter set's graphs not run within the window (bank_policy.is_stale)."""
        graphs = [graph for family in self.families() for graph in family.instances.get(param_set, ())]
        self.release(self.ledger.sweep(param_set, graphs),
                     f"not run in its layer's last {bank_policy.RELEASE_WINDOW} calls per graph of it")

    def release(self, graphs: List[GraphInstance], why: str, force: bool = False) -> None:
        """Release forward/inference instances with their backward graphs, or a backward graph alone (one whose own
        memory is held is kept unless `force`: its outputs or stolen grads are in use, and the aliases keep its
        memory alive; an output arena another member's output holds does not keep it): memory returned, counted,
        the partition's first release logged."""
        released = 0
        for graph in graphs:
            if not graph.alive:
                continue
            if not force and (graph.held_by_itself() or (graph.bw is not None and graph.bw.held_by_itself())):
                continue
            graph.family.forget(graph)  # a backward alone: its forward instance captures it again when needed
            self.ledger.released(graph)
            self.runtime.discard(graph)
            released += 1
        if not released:
            return
        self.ledger.count_releases(released)
        count("graphs_released", released)
        if not self._logged:
            self._logged = True
            log.info("cgcompile: %s: released %d graph(s) (%s), their memory returned; later releases are counted "
                     "in stats()['partitions']", self.describe(), released, why)

    def recapture(self, old: GraphInstance, kind: str, reason: str) -> Tuple[int, Optional[str]]:
        """`old` is stale (a static input moved): discard it. Its replacement's re-capture streak, and why the
        partition should run eagerly for good when that is a storm (bank_policy.storm), else None."""
        streak = self.ledger.recaptured(old)
        self.runtime.discard(old)
        record("recaptures", self.name, reason)
        if bank_policy.storm(streak):
            return streak, (f"re-capture storm: its {kind} graph was re-captured {streak} times in a row without a "
                            f"replay in between ({reason}); capturing it costs more than running it eagerly")
        log.info("cgcompile: re-capturing %s %s graph: %s", self.describe(), kind, reason)
        return streak, None

    def retire_superseded(self, group: ArenaGroup) -> None:
        """Release the graphs of the free arenas a larger size superseded (arena.py): each size captures again into
        a full-size arena at its next call."""
        self.release([graph for arena in group.superseded_free() for graph in arena.member_graphs()],
                     "a larger input size needs more output memory: its size captures again into the larger output "
                     "arena")

    def stop(self, reason: str) -> None:
        """Stop capturing new sizes for good: log once with the fix, count, release the graphs never replayed.
        The graphs it keeps still replay; other sizes run eagerly."""
        message = self.ledger.stop(reason, self.growth())
        log.warning("cgcompile: %s stops capturing new sizes: %s", self.describe(), message)
        record("bank_stops", self.name, message, once=True)
        self.release([graph for family in self.families() for graph in family.all_instances() if graph.replays <= 1],
                     "never replayed")

    def families(self) -> List[Any]:
        """The forward/inference graph families of the partition's bank."""
        return [family for entry in self.bank.values() for family in (entry.forward, entry.inference)
                if family is not None]

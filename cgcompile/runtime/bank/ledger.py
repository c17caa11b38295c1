"""The graph-bank ledger of one partition: the state the bank policy (policy.py) decides on, and its decisions.

Per parameter set (a layer: one compiled frame serves every layer of a model that graph-breaks inside its layers)
a clock of calls, its live graphs, its warmup and the graphs awaiting judgement; per live forward/inference
instance its last use and re-capture streak; the input sizes awaiting judgement; the partition's counters
(stats()["partitions"]). The ledger decides (which graphs are wasted or stale, when to stop capturing new
sizes); the partition runner (runtime/local/runner.py) acts on the answers: it releases graphs, logs, falls back.
Graphs are only read here (their `replays` and `alive`), never changed.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

from . import policy

__all__ = ["BankLedger", "ParamSetState", "Usage"]


@dataclasses.dataclass
class ParamSetState:
    """One parameter set's clock, live graphs, warmup and graphs awaiting judgement."""

    calls: int = 0  # forward/inference calls with it: the clock its graphs are judged on
    graphs: int = 0  # its live forward/inference instances
    # warmup calls per graph family, or per bank key not compiled yet (its calls run uncompiled, adopt_warmups)
    warm: Dict[Any, int] = dataclasses.field(default_factory=dict)
    unjudged: "collections.deque" = dataclasses.field(default_factory=collections.deque)  # (captured at, graph ref)
    next_sweep: int = 0
    captures: int = 0  # graphs it ever captured


@dataclasses.dataclass
class Usage:
    """One live forward/inference instance's record."""

    param_set: int
    last_use: int  # its parameter set's clock when it last ran
    recapture_streak: int = 0


class BankLedger:
    """One partition's graph-bank accounting and policy state (fresh at creation and after release())."""

    def __init__(self, warmup_steps: int, max_graphs: int):
        self.warmup_steps = warmup_steps
        self.max_graphs = max_graphs
        self.reset()

    def reset(self) -> None:
        """Start over (at creation and after release()): no counts, no state."""
        self.counters = policy.BankCounters()
        self.param_sets: Dict[int, ParamSetState] = {}
        self.usage: Dict[Any, Usage] = {}  # forward/inference instance alive -> its record
        # bank key -> [counters.calls when first seen, the parameter sets that met it once (None: one met it again)]
        self.unjudged_sizes: Dict[Any, list] = {}
        self.sizes_seen: Dict[Any, None] = {}  # every bank key seen before a stop, in the order they first came
        self.seen_after_stop: Dict[Any, None] = {}  # the latest bank keys seen after a stop (SIZES_KEPT_AFTER_STOP)
        self.sizes_judged = 0
        self.sets_gone_uncaptured = 0  # parameter sets whose identity died before they captured anything

    def state(self, param_set: int) -> ParamSetState:
        found = self.param_sets.get(param_set)
        if found is None:
            found = self.param_sets[param_set] = ParamSetState()
        return found

    # what happened ------------------------------------------------------------------------------------------

    def warming_up(self, family: Any, param_set: int) -> bool:
        """A forward/inference call of `family` begins: count it on the clocks; True while it is one of that
        parameter set's warmup calls (run eagerly)."""
        state = self.state(param_set)
        state.calls += 1
        counters = self.counters
        counters.calls += 1
        done = state.warm.get(family, 0)
        if done >= self.warmup_steps:
            return False
        state.warm[family] = done + 1
        counters.warmup_calls += 1
        counters.misses += 1
        return True

    def size_seen(self, bank_key: Any, param_set: int) -> None:
        """A call of an input size that may still be awaiting judgement. A size repeats when a parameter set meets
        it again: in a frame one layer after another calls, every layer meets each step's size once."""
        sizes = self.unjudged_sizes.get(bank_key)
        if sizes is not None and sizes[1] is not None:
            if param_set in sizes[1]:
                sizes[1] = None
            else:
                sizes[1].add(param_set)

    def not_compiled(self, bank_key: Any, param_set: int) -> Tuple[bool, Optional[str]]:
        """A call of a size with no compiled entry: (was it seen before (size_seen), else why to stop capturing new
        sizes, the sizes seen before judged (size_arrived))."""
        if bank_key in self.sizes_seen:
            self.size_seen(bank_key, param_set)
            return True, None
        if bank_key in self.seen_after_stop:
            return True, None
        stop = self.size_arrived()
        if stop is not None or self.counters.stopped is not None:  # sizes are not kept after a stop: only the
            self.seen_after_stop[bank_key] = None  # latest few, so a size met by every layer counts once
            if len(self.seen_after_stop) > policy.SIZES_KEPT_AFTER_STOP:
                del self.seen_after_stop[next(iter(self.seen_after_stop))]
        return False, stop

    def met_before(self, bank_key: Any, param_set: int) -> bool:
        """Did `param_set` run this size uncompiled at an earlier call (uncompiled_warmup)?"""
        state = self.param_sets.get(param_set)
        return state is not None and bank_key in state.warm

    def size_arrived(self) -> Optional[str]:
        """A call brought an input size never seen: counted, and the sizes seen before judged (judge_sizes)."""
        self.counters.sizes += 1
        return self.judge_sizes()

    def new_size(self, bank_key: Any, param_set: int) -> None:
        """A size seen for the first time: judged JUDGE_AFTER calls per parameter set from now."""
        self.unjudged_sizes[bank_key] = [self.counters.calls, {param_set}]
        self.sizes_seen[bank_key] = None

    def uncompiled_warmup(self, bank_key: Any, param_set: int) -> None:
        """A size's first call with this parameter set, run uncompiled (a size compiles when it comes again):
        counted as one of its warmup calls, on the bank key until its graph family takes it over (adopt_warmups).
        The runner defers only with 2 or more warmup calls, so this call is always one."""
        self.warming_up(bank_key, param_set)

    def adopt_warmups(self, bank_key: Any, family: Any) -> None:
        """`bank_key` compiled into `family`: the warmup calls its size ran uncompiled count as the family's."""
        for state in self.param_sets.values():  # (a set whose identity died is gone already, with its calls)
            calls = state.warm.pop(bank_key, 0)
            if calls:
                state.warm[family] = state.warm.get(family, 0) + calls

    def uncompiled_call(self) -> None:
        """A call of a new size after the partition stopped capturing them: run eagerly."""
        self.counters.calls += 1
        self.counters.misses += 1

    def replayed(self, param_set: int, graph: Any) -> Optional[Usage]:
        """A call replayed `graph`, captured at an earlier call; its record (None for a backward graph)."""
        self.counters.replays += 1
        usage = self.usage.get(graph)
        if usage is not None:
            usage.last_use = self.state(param_set).calls
        return usage

    def steady_replays(self, state: ParamSetState, usage: Usage, bank_key: Any, calls: int) -> None:
        """`calls` steady replays of one graph, counted in one batch (runtime/local/runner.py)."""
        state.calls += calls
        self.counters.calls += calls
        self.counters.replays += calls
        usage.last_use = state.calls
        self.size_seen(bank_key, usage.param_set)

    def captured(self, param_set: int, graph: Any, streak: int = 0) -> None:
        state = self.state(param_set)
        self.counters.captures += 1
        self.counters.misses += 1
        state.graphs += 1
        state.captures += 1
        state.unjudged.append((state.calls, weakref.ref(graph)))
        self.usage[graph] = Usage(param_set, state.calls, streak)

    def missed(self) -> None:
        """A call ran eagerly after warmup (stopped, no room)."""
        self.counters.misses += 1

    def set_gone(self, param_set: int) -> Optional[str]:
        """A parameter set's identity died: its state goes. Why the partition should run eagerly for good, when
        sets keep going before any captured (policy.never_warm: a per-call identity, so warmup never ends)."""
        state = self.param_sets.pop(param_set, None)
        if state is not None and not state.captures:
            self.sets_gone_uncaptured += 1
        if self.counters.captures == 0 and policy.never_warm(self.sets_gone_uncaptured, self.warmup_steps):
            return (f"{self.sets_gone_uncaptured} parameter sets came and went before any captured a graph: its "
                    f"parameter set is known by an object made anew on every call, so every call starts a new "
                    f"warmup and nothing would ever be captured")
        return None

    def no_room(self, param_set: int) -> Optional[str]:
        """Why this parameter set may not have another forward/inference instance (max_graphs_per_partition)."""
        if self.state(param_set).graphs < self.max_graphs:
            return None
        return (f"max_graphs_per_partition={self.max_graphs} reached (every instance held or captured for other "
                f"inputs); this call runs eagerly")

    def released(self, graph: Any) -> None:
        """A forward/inference instance left (released, stale, discarded)."""
        usage = self.usage.pop(graph, None)
        state = self.param_sets.get(usage.param_set) if usage is not None else None
        if state is not None:  # (a set whose identity died is gone already)
            state.graphs -= 1

    def recaptured(self, old: Any) -> int:
        """`old` was stale and is replaced: its replacement's re-capture streak (policy.storm tells a storm)."""
        usage = self.usage.get(old)
        self.released(old)
        self.counters.recaptures += 1
        return policy.recapture_streak(usage.recapture_streak if usage else 0, old.replays)

    def count_releases(self, released: int) -> None:
        self.counters.releases += released

    def outputs_copied(self, positions: int) -> None:
        self.counters.copied_outputs += positions

    def broken(self, reason: str, storm: bool) -> None:
        """The partition runs eagerly for good: its graphs are gone (a storm also stops it capturing)."""
        self.usage = {}
        for state in self.param_sets.values():
            state.graphs = 0
            state.unjudged.clear()
        if storm:
            self.counters.stopped = reason

    def stop(self, reason: str, growth: Optional[Tuple[str, str]] = None) -> str:
        """Stop capturing new sizes for good; the message to log (`growth`: policy.stop_message)."""
        self.counters.stopped = policy.stop_message(reason, growth)
        return self.counters.stopped

    # decisions ----------------------------------------------------------------------------------------------

    def due(self, param_set: int) -> bool:
        """Is a judgement or a sweep due for this parameter set?"""
        state = self.param_sets.get(param_set)
        return state is not None and (bool(state.unjudged) or state.calls >= state.next_sweep)

    def quiet_calls(self, state: ParamSetState) -> int:
        """How many calls of a parameter set whose last call was a steady replay (runtime/local/steady.py) may pass
        before its policy has anything to do: none while a graph awaits judgement; else until the next sweep, or
        without end while the set has one live graph, which those replays keep in use (a sweep would keep it)."""
        if state.unjudged:
            return 1
        if state.graphs == 1:
            return sys.maxsize
        return state.next_sweep - state.calls

    def judge(self, param_set: int) -> Tuple[List[Any], Optional[str]]:
        """Graphs of this parameter set not run again within JUDGE_AFTER of its calls per graph of it: wasted (to
        release); and why to stop capturing new sizes, when most judged graphs were (policy.mostly_wasted)."""
        state = self.param_sets[param_set]
        wasted = []
        cycle = policy.cycle(state.graphs, len(self.sizes_seen))
        counters = self.counters
        while state.unjudged and policy.is_judged(state.unjudged[0][0], state.calls, cycle):
            graph = state.unjudged.popleft()[1]()
            if graph is None or not graph.alive:
                continue
            counters.judged += 1
            if graph.replays <= 1:  # its only replay was the capture's own
                counters.wasted += 1
                wasted.append(graph)
        stop = None
        if counters.stopped is None and policy.mostly_wasted(counters.wasted, counters.judged):
            stop = f"{counters.wasted} of its {counters.judged} graphs judged so far were never replayed after their capture"
        return wasted, stop

    def judge_sizes(self) -> Optional[str]:
        """Sizes first seen JUDGE_AFTER calls per parameter set ago are judged: met once only by each parameter set
        that met them, they did not repeat. Why to stop capturing new sizes, when most judged did not
        (policy.mostly_wasted)."""
        cycle = max(1, len(self.param_sets))
        counters = self.counters
        for bank_key, (first, met_once) in list(self.unjudged_sizes.items()):
            if not policy.is_judged(first, counters.calls, cycle):
                break
            del self.unjudged_sizes[bank_key]
            self.sizes_judged += 1
            counters.one_off_sizes += met_once is not None
        if counters.stopped is None and policy.mostly_wasted(counters.one_off_sizes, self.sizes_judged):
            return (f"{counters.one_off_sizes} of the {self.sizes_judged} input sizes judged so far came once and "
                    f"not again")
        return None

    def sweep(self, param_set: int, graphs: Iterable[Any]) -> List[Any]:
        """This parameter set's graphs not run within the window (policy.is_stale): to release. A sweep is a pass
        over the set's graphs, so it comes once per RELEASE_WINDOW of its calls."""
        state = self.param_sets[param_set]
        state.next_sweep = state.calls + policy.RELEASE_WINDOW
        cycle = policy.cycle(state.graphs, len(self.sizes_seen))
        return [graph for graph in graphs if policy.is_stale(self.usage[graph].last_use, state.calls, cycle)]


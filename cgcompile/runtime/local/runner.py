"""The local runtime, per partition: each captured partition runs as forward/backward (or inference) graphs.

Per partition, aot_autograd (run lazily at the first call of each input signature, with the real tensors)
splits the submodule into functional aten forward and backward graphs, each run by a `GraphFamily`
(runtime/local/family.py: one `BankEntry` per graph-bank key, runtime/bank/key.py). This module is the partition's side:
`PartitionRunner` (the steady inference replay, the graph bank and its policy, every counter and clock of it,
warmup per parameter set, eager fallback; its output arenas' sizes in runtime/memory/arena_sizing.py, its inputs' names and
labels in runtime/local/inputs.py); runtime/local/compile.py builds one.

The rules they follow live next to the code that keeps them: the buffer rules (static, borrowed, in-place and
owned inputs, aliased outputs, held graphs and their instances, backward instances, stolen grads) in graph.py's
docstring, with `GraphInstance`; which outputs are handed out as copies in runtime/local/family.py; the memory pool and
its rule, the registry of static memory and the list of live graphs in ModelRuntime (runtime/local/model_runtime.py).

Parameter sets: Dynamo reuses one compiled frame for every layer of a model that graph-breaks inside its layers,
so one partition may serve many parameter sets, each needing graphs of its own (as Megatron has per layer). Each
is known by the identity of the partition's first parameter object (`call_key`, runtime/bank/key.py: a parameter that
moves, e.g. `p.data = ...`, stays in its set) and has its own warmup (every layer runs
`cuda_graph_warmup_steps` eager calls before its first capture, so state built lazily on a layer's first call
is never captured half-built), its own cap and its own clock for the bank policy (runtime/bank/policy.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from ... import _compat
from ...counters import add as count, add_replays, record
from ..bank import policy as bank_policy
from ..memory.arena import ArenaGroup
from ..memory.arena_sizing import ArenaSizing
from ..bank.key import BankKey
from ..drivers.base import Driver
from .instance import GraphInstance
from .family import BankEntry
from .model_runtime import ModelRuntime
from .inputs import PartitionInputs

__all__ = ["PartitionRunner"]

# the mode reads of the steady replay's key check, bound once
_is_grad_enabled, _is_inference_mode_enabled, _any_autocast = (torch.is_grad_enabled, torch.is_inference_mode_enabled,
                                                              _compat.any_autocast)
_increment_versions = _compat.increment_versions

log = logging.getLogger("cgcompile")


@dataclasses.dataclass
class _ParamSet:
    """The bank policy's state for one parameter set (a layer): its clock, live graphs, warmup, judging."""

    calls: int = 0  # forward/inference calls with it: the clock its graphs are judged on
    graphs: int = 0  # its live forward/inference instances
    warm: Dict[Any, int] = dataclasses.field(default_factory=dict)  # warmup calls per graph family
    unjudged: "collections.deque" = dataclasses.field(default_factory=collections.deque)  # (captured at, graph ref)
    next_sweep: int = 0


@dataclasses.dataclass
class _Usage:
    """The bank policy's record of one forward/inference instance."""

    key: int  # its parameter set
    last_use: int  # its parameter set's clock when it last ran
    recapture_streak: int = 0


@dataclasses.dataclass(slots=True)
class _SteadyReplay:
    """What a parameter set's steady inference replay needs, from the last direct call that replayed a graph."""

    key: tuple  # the bank key of that call
    modes_only: bool  # the key is its grad and inference modes alone, autocast off (no input metadata in it)
    grad: bool  # those modes
    inference: bool
    graph: GraphInstance
    copies: Set[int]  # its family's output positions handed out as copies (the family's set, updated in place)
    plain: bool  # a plain graph (graph.py) replayed under no_grad: replay_plain serves it while no output is copied
    bumped: Optional[Callable[[Sequence[Any]], tuple]]  # the arguments whose versions a call bumps
    state: _ParamSet
    usage: _Usage
    # bound once, as the call reads them (each lookup on the way there is host time on every replay)
    addresses_match: Callable[[Sequence[Any]], bool]  # graph.addresses_match
    free: Callable[[], bool]  # may the graph's memory be written: claim.take (plain) or graph.free
    pool_blocker: Callable[[GraphInstance], Optional[GraphInstance]]  # the runtime's
    note_replay: Callable[[GraphInstance], None]  # the runtime's
    replay_plain: Callable[[Sequence[Any]], List[Any]]  # graph.replay_plain
    # Its replays not yet on the policy's clocks and in stats(), and how many may wait before the policy is due
    # (_settle): counting a steady replay is one increment; the clocks are brought up to date where they are read.
    pending: int = 0
    quiet: int = 0
    counted: int = 0  # of the pending, those already in stats()' replay counts (not plain: replay() counts its own)


class PartitionRunner:
    """The callable compile_partition returns for one captured partition: graph bank, warmup/capture,
    permanent eager fallback. (`Partition` is the plan's record of the same partition, plan.py.)"""

    def __init__(self, submod: fx.GraphModule, as_tuple: Tuple[Optional[type], fx.GraphModule], name: str,
                 static_input_indices: Sequence[int],
                 runtime: ModelRuntime, location: Optional[str], driver: Driver, frame: Optional[str] = None,
                 input_names: Sequence[str] = (), sized: bool = False,
                 batch_at: Optional[Tuple[int, int]] = None, static_shapes: bool = False):
        self.submod = submod
        self.name = name
        self.location = location
        self.static_indices = frozenset(static_input_indices)
        self.runtime = runtime
        self.config = runtime.config
        self.driver = driver
        self.container, self.traced = as_tuple  # (container of submod's result, a tuple-returning copy for aot)
        self.bank: Dict[Any, BankEntry] = {}
        self.broken: Optional[str] = None
        self.frame = frame or (os.path.basename(location) if location else "?")
        # Input sizes that vary (symbolic in the trace): graphs of one kind and parameter set write their outputs
        # into shared output arenas (arena.py), so memory follows the largest size, not the number of sizes.
        self.sized = sized
        self.call_key = 0  # the parameter set of the call in progress (the identity of its first parameter)
        self._direct: Optional[Tuple[Any, BankEntry]] = None  # its (bank key, entry) when it calls a graph directly
        self.keys = BankKey(self.static_indices, static_shapes)  # a call's bank key and parameter set
        self._warned: set = set()
        self.inputs = PartitionInputs(submod, name, self.frame, location, self.static_indices, input_names)
        self.describe = self.inputs.describe  # how logs name the partition
        self.arenas = ArenaSizing(name, self.config.capture_sizes, batch_at, self.inputs.param_set_number)
        self._start_policy()
        runtime.add_runner(self)

    def _start_policy(self) -> None:
        """The bank policy's state, fresh (at creation and after release())."""
        self.counters = bank_policy.BankCounters()
        self._param_sets: Dict[int, _ParamSet] = {}
        self._usage: Dict[GraphInstance, _Usage] = {}  # forward/inference instances alive (removed when released)
        self._unjudged_sizes: Dict[Any, List[int]] = {}  # bank key -> [counters.calls when first seen, calls]
        self._steady: Dict[int, _SteadyReplay] = {}  # per parameter set, the graph its last direct call replayed
        self._sizes_judged = 0

    # calls -----------------------------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        """A call of the partition. The steady inference replay is flattened here, as its host work is what the
        product costs per replay: the graph a parameter set replayed at its last direct call (`_SteadyReplay`, made
        by note_replay), replayed again for the same bank key with the full path's decisions for that one case
        (runtime/local/family.py), counted by _settle. Every other case, and a failed partition, takes _call."""
        steady = self._steady
        if steady:
            index = self.keys.set_index
            record = steady.get(0 if index is None else id(args[index]))
            if record is not None and (
                    _is_grad_enabled() is record.grad and _is_inference_mode_enabled() is record.inference
                    and not _any_autocast() if record.modes_only else self.keys.of(args) == record.key) \
                    and record.addresses_match(args) and not self.runtime.dead:
                graph = record.graph
                if graph.captured is not None and record.free() and record.pool_blocker(graph) is None:
                    copies = record.copies
                    if record.plain and not copies:
                        out = record.replay_plain(args)
                    else:
                        out = graph.replay(args, True, copies)
                        record.counted += 1  # in stats() by replay() itself
                    record.note_replay(graph)
                    record.pending += 1  # counted on the policy's clocks by _settle, before anything reads them
                    if record.pending >= record.quiet:
                        self._settle(record)
                    if record.bumped is not None:
                        _increment_versions(record.bumped(args))
                    return out[0] if self.container is None else self.container(out)
        return self._call(args)

    def _call(self, args: tuple) -> Any:
        if self._steady:
            self.settle_all()
        if self.broken is not None:
            return self.submod(*args)
        if self.runtime.dead:
            self.runtime.release_dead()
        if self.keys.dynamic is None:
            self.keys.learn(args)
        key = self.keys.of(args)
        entry = self.bank.get(key)
        if entry is None:
            entry = self._new_entry(key, args)
            if entry is None:
                return self.submod(*args)
        elif self._unjudged_sizes and key in self._unjudged_sizes:
            self._unjudged_sizes[key][1] += 1
        self.inputs.begin(args)
        self.call_key = self.keys.param_set(args)
        direct = entry.bumps is not None
        if direct:  # a replay in it becomes its parameter set's steady replay (note_replay)
            self._direct = (key, entry)
        try:
            out = entry.run_direct(args) if direct else entry.fn(*args)
        finally:
            self.inputs.end()
            self._direct = None
        if self.container is None:
            return out[0]
        return self.container(out)

    def _new_entry(self, key: tuple, args: Sequence[Any]) -> Optional[BankEntry]:
        """A call brought an input signature never seen: judge the sizes seen before, compile this one (None:
        the call runs uncompiled, the partition having stopped capturing new sizes or failed)."""
        counters = self.counters
        counters.sizes += 1
        self._judge_sizes()
        if counters.stopped is not None:  # no compile for a size that will not be captured
            counters.calls += 1
            counters.misses += 1
            return None
        try:
            entry = self.bank[key] = BankEntry(self, args)
        except Exception as exc:
            self.fail(f"compiling it failed: {type(exc).__name__}: {exc}")
            return None
        self._unjudged_sizes[key] = [self.counters.calls, 1]
        return entry

    def bank_size(self) -> int:
        """How many input signatures (graph-bank keys) have a compiled entry now."""
        return len(self.bank)

    # the bank policy (runtime/bank/policy.py): what runtime/local/family.py reports, and the decisions -------------------------

    def bank_counters(self) -> bank_policy.BankCounters:
        """The graph-bank accounting, up to date (stats()): steady replays still pending are counted first (this
        runs no policy: a record settles at the replay where the policy becomes due)."""
        self.settle_all()
        return self.counters

    @property
    def stopped(self) -> Optional[str]:
        """Why this partition stopped capturing new sizes, or None."""
        return self.counters.stopped

    def _param_set(self, key: int) -> _ParamSet:
        state = self._param_sets.get(key)
        if state is None:
            state = self._param_sets[key] = _ParamSet()
        return state

    def _settle(self, record: _SteadyReplay) -> None:
        """At a steady replay: count the pending ones (_fold), run the policy if it is due, set how many replays may
        wait before it is due again (a graph awaiting judgement: none; else until the next sweep; sizes are judged
        only on the full path, which folds first)."""
        state = record.state
        if self._fold(record) and (state.unjudged or state.calls >= state.next_sweep):
            self.after_call(record.graph.key)
        record.quiet = 1 if state.unjudged else state.next_sweep - state.calls

    def _fold(self, record: _SteadyReplay) -> int:
        """Put a record's pending replays on the clocks and counters and in stats(), as each would have been
        counted; how many. It runs no policy: a fold between replays finds none due (pending < quiet)."""
        calls, record.pending = record.pending, 0
        if calls:
            plain, record.counted = calls - record.counted, 0
            add_replays(plain, plain)  # each a steady one: the record was made at a replay after the capture
            state = record.state
            state.calls += calls
            counters = self.counters
            counters.calls += calls
            counters.replays += calls
            record.usage.last_use = state.calls
            sizes = self._unjudged_sizes.get(record.key)
            if sizes is not None:
                sizes[1] += calls
        return calls

    def settle_all(self) -> None:
        """Bring the clocks and counters up to date before the full path or a reader (stats(), release, a failure,
        the model's end) uses them; each record settles again at its next replay, as what the caller does next may
        change when the policy is due. Only counts: the policy runs at replays, in the thread that replays."""
        for record in list(self._steady.values()):
            self._fold(record)
            record.quiet = 0

    def __del__(self) -> None:  # the model went: its last steady replays still count in stats()
        with contextlib.suppress(Exception):  # at interpreter exit the modules may be gone already
            self.settle_all()

    def warming_up(self, family: Any, key: int) -> bool:
        """A forward/inference call of `family` with parameter set `key` begins: count it on the clocks; True
        while it is one of that parameter set's warmup calls (run eagerly)."""
        state = self._param_set(key)
        state.calls += 1
        counters = self.counters
        counters.calls += 1
        done = state.warm.get(family, 0)
        if done >= self.config.cuda_graph_warmup_steps:
            return False
        state.warm[family] = done + 1
        counters.warmup_calls += 1
        counters.misses += 1
        return True

    def note_replay(self, key: int, graph: GraphInstance) -> None:
        """A call replayed `graph`, captured at an earlier call. At a direct inference call (no aot wrapper around
        it), the graph becomes this parameter set's steady replay (__call__)."""
        self.counters.replays += 1
        usage = self._usage.get(graph)
        if usage is not None:
            state = self._param_set(key)
            usage.last_use = state.calls
            if self._direct is not None and graph.kind == "inference":
                bank_key, entry = self._direct
                modes_only = not self.keys.dynamic and not any(bank_key[2:4])
                plain = graph.plain and graph.arena is None and modes_only and not bank_key[0]
                runtime = self.runtime
                self._steady[key] = _SteadyReplay(
                    bank_key, modes_only, bank_key[0], bank_key[1], graph, entry.inference.copy_out, plain,
                    entry.bumped, state, usage, graph.addresses_match, graph.claim.take if plain else graph.free,
                    runtime.pool_blocker, runtime.note_replay, graph.replay_plain)
        self.runtime.note_replay(graph)

    def note_capture(self, key: int, graph: GraphInstance, streak: int = 0) -> None:
        """A call captured `graph` (and replayed it for its own results)."""
        state = self._param_set(key)
        self.counters.captures += 1
        self.counters.misses += 1
        state.graphs += 1
        state.unjudged.append((state.calls, weakref.ref(graph)))
        self._usage[graph] = _Usage(key, state.calls, streak)
        self.runtime.note_replay(graph)

    def note_eager(self, key: int, reason: Optional[str] = None) -> None:
        """A call ran eagerly (stopped, or no room): counted, and with a reason logged once per reason."""
        self.counters.misses += 1
        if reason is not None:
            record("eager_fallbacks", self.name, reason, once=True)
            if reason not in self._warned:
                self._warned.add(reason)
                log.warning("cgcompile: %s: %s", self.describe(), reason)

    def note_copy_out(self, kind: str, positions: List[int]) -> None:
        """A graph family hands these output positions out as copies from now on: logged once per family kind."""
        self.counters.copied_outputs += len(positions)
        if ("copies", kind) not in self._warned:
            self._warned.add(("copies", kind))
            log.info("cgcompile: %s: outputs %s of its %s graph are still referenced at its next call (e.g. kept by "
                     "an eager island's autograd context or the caller): handed out as copies from now on, so the "
                     "graph replays", self.describe(), positions, kind)

    def has_room(self, key: int) -> bool:
        """May parameter set `key` have another forward/inference instance (max_graphs_per_partition)?"""
        return self._param_set(key).graphs < self.config.max_graphs_per_partition

    def recapturing(self, key: int, old: GraphInstance, kind: str, reason: str) -> Optional[int]:
        """`old` is stale (a static input moved): discard it; its replacement's re-capture streak, or None when
        that is a storm (the partition then runs eagerly for good)."""
        usage = self._usage.pop(old, None)
        streak = bank_policy.recapture_streak(usage.recapture_streak if usage else 0, old.replays)
        self._param_set(key).graphs -= 1
        self.runtime.discard(old)
        self.counters.recaptures += 1
        record("recaptures", self.name, reason)
        if bank_policy.storm(streak):
            self.fail(f"re-capture storm: its {kind} graph was re-captured {streak} times in a row without a replay "
                      f"in between ({reason}); capturing it costs more than running it eagerly", storm=True)
            return None
        log.info("cgcompile: re-capturing %s %s graph: %s", self.describe(), kind, reason)
        return streak

    def after_call(self, key: int) -> None:
        """After a forward/inference call: judge the graphs of its parameter set old enough, release the stale."""
        state = self._param_sets.get(key)
        if state is None:
            return
        if state.unjudged:
            self._judge(state)
        if state.calls >= state.next_sweep:
            self._sweep(key, state)

    def _judge(self, state: _ParamSet) -> None:
        """A graph not run again within JUDGE_AFTER calls of its parameter set per graph of it is wasted: released;
        stop capturing new sizes when most judged graphs were (bank_policy.mostly_wasted)."""
        wasted = []
        cycle = bank_policy.cycle(state.graphs, len(self.bank))
        while state.unjudged and bank_policy.is_judged(state.unjudged[0][0], state.calls, cycle):
            graph = state.unjudged.popleft()[1]()
            if graph is None or not graph.alive:
                continue
            self.counters.judged += 1
            if graph.replays <= 1:  # its only replay was the capture's own
                self.counters.wasted += 1
                wasted.append(graph)
        self.release_graphs(wasted, f"not run again within {bank_policy.JUDGE_AFTER} calls of its layer per graph "
                                    f"of it after its capture")
        counters = self.counters
        if counters.stopped is None and bank_policy.mostly_wasted(counters.wasted, counters.judged):
            self.stop(f"{counters.wasted} of its {counters.judged} graphs judged so far were never replayed after "
                      f"their capture")

    def _judge_sizes(self) -> None:
        """Sizes first seen JUDGE_AFTER calls per parameter set ago are judged: seen once only, they did not repeat;
        stop capturing new sizes when most judged did not (bank_policy.mostly_wasted)."""
        cycle = max(1, len(self._param_sets))
        counters = self.counters
        for key, (first, calls) in list(self._unjudged_sizes.items()):
            if not bank_policy.is_judged(first, self.counters.calls, cycle):
                break
            del self._unjudged_sizes[key]
            self._sizes_judged += 1
            counters.one_off_sizes += calls == 1
        if counters.stopped is None and bank_policy.mostly_wasted(counters.one_off_sizes, self._sizes_judged):
            self.stop(f"{counters.one_off_sizes} of the {self._sizes_judged} input sizes judged so far came once and "
                      f"not again")

    def _sweep(self, key: int, state: _ParamSet) -> None:
        """Release this parameter set's graphs not run within the window (bank_policy.is_stale)."""
        window = bank_policy.RELEASE_WINDOW
        state.next_sweep = state.calls + window  # a sweep is a pass over the set's graphs: not on every call
        cycle = bank_policy.cycle(state.graphs, len(self.bank))
        stale = [graph for graph in self._graphs_of(key)
                 if bank_policy.is_stale(self._usage[graph].last_use, state.calls, cycle)]
        self.release_graphs(stale, f"not run in its layer's last {window} calls per graph of it")

    def _graphs_of(self, key: int) -> List[GraphInstance]:
        return [graph for entry in self.bank.values() for family in (entry.forward, entry.inference)
                if family is not None for graph in family.instances.get(key, ())]

    def release_graphs(self, graphs: List[GraphInstance], why: str, force: bool = False) -> None:
        """Release forward/inference instances with their backward graphs, or a backward graph alone (a held one is
        kept unless `force`: its outputs or stolen grads are in use, and the aliases keep its memory alive): memory
        returned, counted, the partition's first release logged."""
        released = 0
        for graph in graphs:
            if not graph.alive:
                continue
            if not force and (graph.held() or (graph.bw is not None and graph.bw.held())):
                continue
            if graph.kind == "backward":  # alone (arena.py): its forward instance captures it again when needed
                graph.family.entry.forward.drop_backward(graph)
            else:
                graph.family.remove(graph)
                usage = self._usage.pop(graph, None)
                if usage is not None:
                    self._param_set(usage.key).graphs -= 1
            self.runtime.discard(graph)
            released += 1
        if not released:
            return
        self.counters.releases += released
        count("graphs_released", released)
        if "release" not in self._warned:
            self._warned.add("release")
            log.info("cgcompile: %s: released %d graph(s) (%s), their memory returned; later releases are counted "
                     "in stats()['partitions']", self.describe(), released, why)

    def retire_superseded(self, group: ArenaGroup) -> None:
        """Release the graphs of the free arenas a larger size superseded (arena.py): each size captures again into
        a full-size arena at its next call."""
        self.release_graphs([graph for arena in group.superseded_free() for graph in arena.member_graphs()],
                            "a larger input size needs more output memory: its size captures again into the "
                            "larger output arena")

    def stop(self, reason: str) -> None:
        """Stop capturing new sizes for good: log once with the fix, count, release the graphs never replayed.
        The graphs it keeps still replay; other sizes run eagerly."""
        self.counters.stopped = bank_policy.stop_message(reason)
        log.warning("cgcompile: %s stops capturing new sizes: %s", self.describe(), self.counters.stopped)
        record("bank_stops", self.name, self.counters.stopped, once=True)
        self.release_graphs([graph for entry in self.bank.values() for family in (entry.forward, entry.inference)
                             if family is not None for graph in family.all_instances() if graph.replays <= 1],
                            "never replayed")

    def fail(self, reason: str, storm: bool = False) -> None:
        """Fall back to eager for good: log once, count (a re-capture storm in stats()["bank_stops"], other
        causes in "eager_fallbacks"), release graphs. The current call still completes."""
        if self.broken is not None:
            return
        self.broken = reason
        self.settle_all()
        self._usage = {}
        self._steady = {}
        if storm:
            self.counters.stopped = reason
        log.warning("cgcompile: %s runs eagerly from now on: %s", self.describe(), reason)
        record("bank_stops" if storm else "eager_fallbacks", self.name, reason, once=True)
        for entry in self.bank.values():
            entry.discard()
        self.bank = {}

    def release(self) -> None:
        """Forget every graph (cgcompile.release()): the next call compiles, warms up and captures anew, and the
        bank policy starts over with its accounting."""
        self.settle_all()
        for entry in self.bank.values():
            entry.discard()
        self.bank = {}
        self.arenas.forget_groups()
        self._start_policy()


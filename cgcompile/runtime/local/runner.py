"""The local runtime, per partition: each captured partition runs as forward/backward (or inference) graphs.

Per partition, aot_autograd (run lazily at the first call of each input signature, with the real tensors; for a
partition whose sizes vary, at a size's second call: its first runs uncompiled, see `compiles_on_second_call`)
splits the submodule into functional aten forward and backward graphs, each run by a `GraphFamily`
(runtime/local/family.py: one `BankEntry` per graph-bank key, runtime/bank/key.py). This module is the
partition's side: `PartitionRunner` (the calls, the steady inference replay and the batched counting of its
replays, the graph bank, eager fallback). Its ledger (runtime/bank/ledger.py) keeps every counter and clock and
decides; its releaser (runtime/local/releaser.py) carries the decisions out; its output arenas' sizes are in
runtime/memory/arena_sizing.py, its inputs' names and labels in runtime/local/inputs.py; runtime/local/compile.py
builds one.

The rules they follow live next to the code that keeps them: the buffer rules (static, borrowed, in-place and
owned inputs, aliased outputs, held graphs and their instances, backward instances, stolen grads) in
runtime/local/instance.py's docstring, with `GraphInstance`; which outputs are handed out as copies in
runtime/local/family.py; the memory pool and its rule and the registry of static memory in
runtime/memory/registry.py.

Parameter sets: Dynamo reuses one compiled frame for every layer of a model that graph-breaks inside its layers,
so one partition may serve many parameter sets, each needing graphs of its own (as Megatron has per layer). Each
is known by an identity stable by construction (runtime/bank/key.py: a parameter object a module registers, so a
parameter that moves, e.g. `p.data = ...`, stays in its set) and has its own warmup (every layer runs
`cuda_graph_warmup_steps` eager calls before its first capture, so state built lazily on a layer's first call
is never captured half-built), its own cap and its own clock for the bank policy (runtime/bank/policy.py). A set
whose identity dies leaves the ledger; sets that keep dying before any capture mean a per-call identity, and the
partition falls back with that reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.fx as fx

from ...counters import record
from ..bank import policy as bank_policy
from ..bank.key import BankKey, ParamSetIdentity
from ..bank.ledger import BankLedger
from ..bank.size_trend import Growth, what_changed
from ..drivers.base import Driver
from ..memory.arena_sizing import ArenaSizing
from .benefit import BenefitProbe
from .call import PartitionCall
from .bank_entry import BankEntry
from .inputs import PartitionInputs
from .instance import GraphInstance
from .model_runtime import ModelRuntime
from .releaser import GraphReleaser
from .steady import SteadyReplay, SteadyReplays

__all__ = ["PartitionRunner"]

log = logging.getLogger("cgcompile")


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
        self.inductor = self.config.fuses_with_inductor(driver.name)  # Inductor compiles its graphs before capture
        self.container, self.traced = as_tuple  # (container of submod's result, a tuple-returning copy for aot)
        self.bank: Dict[Any, BankEntry] = {}
        self.broken: Optional[str] = None
        self.frame = frame or (os.path.basename(location) if location else "?")
        # Input sizes that vary (symbolic in the trace): graphs of one kind and parameter set write their outputs
        # into shared output arenas (arena.py), so memory follows the largest size, not the number of sizes.
        self.sized = sized
        # A size runs uncompiled at a layer's first call (a warmup call), compiled if it comes again: graph-bank.md.
        # Not with capture_sizes (declared sizes repeat) nor under 2 warmup calls (the compiled graph warms up too).
        self.compiles_on_second_call = (sized and batch_at is None and driver.captures
                                        and self.config.cuda_graph_warmup_steps >= 2)
        self.call: Optional[PartitionCall] = None  # the call in progress (call.py)
        self.keys = BankKey(self.static_indices, static_shapes)  # a call's bank key
        self.param_sets = ParamSetIdentity(self.static_indices)  # a call's parameter set
        self._warned: set = set()
        self.inputs = PartitionInputs(submod, name, self.frame, location, self.static_indices, input_names)
        self.describe = self.inputs.describe  # how logs name the partition
        self.arenas = ArenaSizing(name, self.config.capture_sizes, batch_at, self.inputs.param_set_number)
        self.ledger = BankLedger(self.config.cuda_graph_warmup_steps, self.config.max_graphs_per_partition)
        self.releaser = GraphReleaser(name, self.describe, self.bank, self.ledger, runtime,  # acts on its decisions
                                      self.what_changed)
        # per parameter set, the graph its last direct call replayed, replayed again from there (steady.py)
        self.steady = SteadyReplays(self.keys, self.param_sets, self.ledger, self.releaser, runtime, self)
        self.benefit = BenefitProbe(name, self.describe, self.config, driver, self.inputs.static_storages)
        runtime.add_runner(self)

    # calls -----------------------------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        """A call. The steady inference replay is flattened here (its host work is the product's cost per replay):
        the graph a parameter set replayed at its last direct call, replayed again from its record (steady.py).
        Every other case, and a failed partition, takes _call (runtime/local/family.py decides)."""
        steady = self.steady
        record = steady.find(args) if steady.records else None
        if record is None:
            return self._call(args)
        return self._replayed(record, args)

    def leaving(self, args: tuple) -> tuple:
        """A call whose result is at once the frame's only output (a frame that is this one call, split.single_call):
        what `runtime.finish_frame_outputs((self(*args),))` returns. A steady replay of a plain graph copies its
        output straight out of its memory (the frame would copy the alias it was handed at once), so nothing
        handed out holds the graph and no alias is made to be dropped."""
        steady = self.steady
        record = steady.find(args) if steady.records else None
        if record is not None and record.copy_out and not record.family.copied_outputs:
            out = record.replay_plain(args, True)
            steady.after_replay(record, args)
            if steady.compiled is not None:  # the next calls replay in one C call (steady.py)
                steady.arm(record)
            return (out[0],)
        result = self._call(args) if record is None else self._replayed(record, args)
        return self.runtime.finish_frame_outputs((result,))

    def frame_call(self) -> Callable[..., tuple]:
        """What a frame that is this one call calls with the frame's arguments as they come: `leaving(args)`,
        through the compiled steady replay where it is built (steady.py)."""
        def whole_leaving(*args: Any) -> tuple:
            return self.leaving(args)
        return self.steady.compiled or whole_leaving

    def _replayed(self, record: SteadyReplay, args: tuple) -> Any:
        """The call's result from a steady replay of the record SteadyReplays.find gave it (its claim taken)."""
        copied = record.family.copied_outputs
        if record.plain and not copied:
            out = record.replay_plain(args)
        else:
            out = record.graph.replay(args, True, copied)
            record.counted += 1  # in stats() by replay() itself
        self.steady.after_replay(record, args)
        return out[0] if self.container is None else self.container(out)

    def _call(self, args: tuple) -> Any:
        if self.steady.records:
            self.steady.count_pending()
        if self.benefit.meter.open and self.broken is None:  # measured in full: does a replay pay?
            self.fail(self.benefit.settle(max(1, len(self.ledger.param_sets))))
        if self.broken is not None:
            return self.submod(*args)
        if self.runtime.dead:
            self.runtime.release_dead()
        if self.keys.dynamic is None:
            self.keys.learn(args)
            self.param_sets.learn(args)
        key = self.keys.of(args)
        entry = self.bank.get(key)
        param_set = self.param_sets.of(args)
        if self.param_sets.arrived(param_set):
            if self._sets_gone(args):
                return self.submod(*args)
            self.param_sets.watch(args, param_set)
        if entry is None:
            entry = self._new_entry(key, args, param_set)
            if entry is None:
                return self.submod(*args)
        else:
            self.ledger.size_seen(key, param_set)
        direct = entry.bumps is not None  # a replay in it becomes its parameter set's steady replay (replayed())
        outer, self.call = self.call, PartitionCall(args, param_set, key, entry, direct)
        try:
            out = entry.run_direct(args) if direct else entry.fn(*args)
        finally:
            self.call = outer
        if self.container is None:
            return out[0]
        return self.container(out)

    def _new_entry(self, key: tuple, args: Sequence[Any], param_set: int) -> Optional[BankEntry]:
        """A call brought an input signature not compiled: judge the sizes seen before, compile this one (None:
        the call runs uncompiled: the partition stopped capturing new sizes or failed, or the size is new to this
        parameter set and compiles only if it comes again)."""
        ledger = self.ledger
        seen, stop = ledger.not_compiled(key, param_set)
        if stop is not None:
            self.releaser.stop(stop)
        if ledger.counters.stopped is not None:  # no compile for a size that will not be captured
            ledger.uncompiled_call()
            return None
        if self.compiles_on_second_call and not ledger.met_before(key, param_set):
            if not seen:
                ledger.new_size(key, param_set)
            ledger.uncompiled_warmup(key, param_set)
            return None
        try:
            entry = self.bank[key] = BankEntry(self, args)
        except Exception as exc:
            self.fail(f"compiling it failed: {type(exc).__name__}: {exc}")
            return None
        if seen:
            ledger.adopt_warmups(key, entry.forward or entry.inference)
        else:
            ledger.new_size(key, param_set)
        return entry

    def what_changed(self) -> Optional[Growth]:
        """What changed at each new size of the bank, if one thing did (size_trend.what_changed)."""
        return what_changed(list(self.ledger.sizes_seen), self.keys.dynamic or (), self.inputs.input_names)

    def _sets_gone(self, args: Sequence[Any]) -> bool:
        """A new parameter set arrived: the sets whose identity died leave the ledger; True when the partition
        falls back for good, its warmup never ending (BankLedger.set_gone)."""
        for param_set in self.param_sets.gone():
            self.steady.forget(param_set)
            reason = self.ledger.set_gone(param_set)
            if reason is not None:
                self.fail(f"{reason} (the identity is {self.param_sets.describe(args)}; e.g. a tensor flagged as a "
                          f"parameter that is made on every call)")
                return True
        return False

    # counting (the ledger, runtime/bank/ledger.py, keeps the counts; the runner acts on its decisions) ---------

    def bank_counters(self) -> bank_policy.BankCounters:
        """The graph-bank accounting, up to date (stats()): steady replays still pending are counted first (this
        runs no policy: a record catches up at the replay where the policy becomes due)."""
        self.steady.count_pending()
        return self.ledger.counters

    @property
    def stopped(self) -> Optional[str]:
        """Why this partition stopped capturing new sizes, or None."""
        return self.ledger.counters.stopped

    def bank_size(self) -> int:  # how many input signatures (graph-bank keys) have a compiled entry now
        return len(self.bank)

    def __del__(self) -> None:  # the model went: its last steady replays still count in stats()
        with contextlib.suppress(Exception):  # at interpreter exit the modules may be gone already
            self.steady.count_pending()

    # what the graph families report (runtime/local/family.py) -------------------------------------------------

    def warming_up(self, family: Any, param_set: int) -> bool:
        """A forward/inference call of `family` begins: True while it is one of its parameter set's warmup calls."""
        return self.ledger.warming_up(family, param_set)

    def replayed(self, graph: GraphInstance) -> None:
        """A call replayed `graph`, captured at an earlier call. At a direct inference call (no aot wrapper around
        it), the graph becomes its parameter set's steady replay (__call__)."""
        usage = self.ledger.replayed(graph.param_set, graph)
        call = self.call
        if usage is not None and call is not None and call.direct and graph.kind == "inference" \
                and self.param_sets.by_object and not self.benefit.meter.open:  # found by the object's identity;
            # while timing, every call takes the full path (a steady replay is never timed)
            self.steady.remember(graph, call.bank_key, call.entry.bumped, call.entry.bumps, usage,
                                 self.container is None)
        self.runtime.mark_in_flight(graph)

    def captured(self, graph: GraphInstance, streak: int = 0) -> None:
        """A call captured `graph` (and replayed it for its own results)."""
        self.ledger.captured(graph.param_set, graph, streak)
        self.runtime.mark_in_flight(graph)

    def ran_eagerly(self, reason: Optional[str] = None, lesson: Optional[str] = None) -> None:
        """A call ran eagerly after warmup (stopped, no room, or a lesson learnt instead of capturing another
        instance): counted; a reason is logged once per reason and kept in stats()["eager_fallbacks"]."""
        self.ledger.missed()
        if reason is not None:
            record("eager_fallbacks", self.name, reason, once=True)
            self._log_once(reason, logging.WARNING, "cgcompile: %s: %s", self.describe(), reason)
        if lesson == "grads kept":
            self._log_once(lesson, logging.INFO, "cgcompile: %s: a gradient its backward graph handed out was kept "
                           "past its step (`g = p.grad` in a logger, torch.autograd.grad's result): this call runs "
                           "eagerly, and that backward graph hands out copies from now on", self.describe())

    def copies_outputs(self, kind: str, positions: List[int]) -> None:
        """A graph family hands these output positions out as copies from now on: logged once per family kind."""
        self.ledger.outputs_copied(len(positions))
        self._log_once(("copies", kind), logging.INFO,
                       "cgcompile: %s: outputs %s of its %s graph are still referenced at its next call (e.g. kept by "
                       "an eager island's autograd context or the caller): handed out as copies from now on, so the "
                       "graph replays", self.describe(), positions, kind)

    def _log_once(self, topic: Any, level: int, message: str, *args: Any) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            log.log(level, message, *args)

    def fail(self, reason: Optional[str], storm: bool = False) -> None:
        """Fall back to eager for good (no-op without a reason): log once, count (a re-capture storm in
        stats()["bank_stops"], other causes in "eager_fallbacks"), release graphs. The current call completes."""
        if self.broken is not None or reason is None:
            return
        self.broken = reason
        self.steady.count_pending()
        self.steady.clear()
        self.ledger.broken(reason, storm)
        log.warning("cgcompile: %s runs eagerly from now on: %s", self.describe(), reason)
        record("bank_stops" if storm else "eager_fallbacks", self.name, reason, once=True)
        for entry in self.bank.values():
            entry.discard()
        self.bank.clear()

    def release(self) -> None:
        """Forget every graph (cgcompile.release()): the next call compiles, warms up and captures anew, and the
        bank policy starts over with its accounting."""
        self.steady.count_pending()
        for entry in self.bank.values():
            entry.discard()
        self.bank.clear()
        self.steady.clear()
        self.arenas.forget_groups()
        self.ledger.reset()

"""A partition's steady inference replay: its records and their batched counting.

In a decode loop each partition call replays, again and again, the graph its parameter set replayed last. A
direct inference call (no aot wrapper around the graph) that replayed a graph leaves a `SteadyReplay` record for
its parameter set; a later call with the same bank key replays that graph straight from the record when the one
replay rule (GraphInstance.replay_blocker) allows it (PartitionRunner.__call__ and .leaving, runtime/local/runner.py).
Every check the record lets a call skip is one that cannot change between such calls. Counting a steady replay is
one increment: the ledger's clocks and stats() are brought up to date in batches, before anything reads them and
whenever the bank policy becomes due (`catch_up`).

A frame that is one call of the partition, its one output copied out as it leaves (PartitionRunner.leaving: a
decode step in block scope), is served by the compiled steady replay where it is built (`compiled`,
cgcompile/csrc/steady_replay.cpp): after each Python steady replay of such a record, the record is *armed* there,
and the next calls replay in one C call while nothing of the runtime's memory changed (the memory registry's
`changes`, which every replay, capture and discard bumps, stands for the replay rule: a copy-out replay hands
nothing out) and the per-call conditions hold (modes, no freed parameter, the fixed addresses). It replays at most
until the bank policy is due; any other call falls back to the Python path, which disarms the record first,
counting the replays made there as its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ... import _compat
from ...native import STEADY_REPLAY, compiled_host_path
from ...counters import add_replays
from ..bank.key import BankKey, ParamSetIdentity
from ..bank.ledger import BankLedger, ParamSetState, Usage
from .family import GraphFamily
from .instance import GraphInstance
from .releaser import GraphReleaser

__all__ = ["SteadyReplay", "SteadyReplays"]

# the mode reads of the steady replay's key check, bound once
_is_grad_enabled, _is_inference_mode_enabled, _any_autocast = (torch.is_grad_enabled, torch.is_inference_mode_enabled,
                                                              _compat.any_autocast)
_increment_versions = _compat.increment_versions

if STEADY_REPLAY is not None:  # optional, built at install; without it every steady call runs the Python path
    STEADY_REPLAY.setup(_is_grad_enabled, _is_inference_mode_enabled, _any_autocast, _compat.copy_all,
                        _increment_versions, torch.Tensor.clone)


@dataclasses.dataclass(slots=True)
class SteadyReplay:
    """What a parameter set's steady inference replay needs, from the last direct call that replayed a graph."""

    bank_key: tuple  # the bank key of that call
    modes_only: bool  # the key is its grad and inference modes alone, autocast off (no input metadata in it)
    grad: bool  # those modes
    inference: bool
    graph: GraphInstance
    family: GraphFamily  # its family: the output positions it hands out as copies (copied_outputs)
    plain: bool  # a plain graph (instance.py) replayed under no_grad: replay_plain serves it while no output is copied
    bumped: Optional[Callable[[Sequence[Any]], tuple]]  # the arguments whose versions a call bumps
    bump_positions: tuple  # their positions
    state: ParamSetState
    usage: Usage
    # bound once, as the call reads them (each lookup on the way there is host time on every replay)
    addresses_match: Callable[[Sequence[Any]], bool]  # graph.addresses_match
    replay_blocker: Callable[[Callable[[GraphInstance], Optional[GraphInstance]]], Optional[GraphInstance]]
    pool_blocker: Callable[[GraphInstance], Optional[GraphInstance]]  # the runtime's
    mark_in_flight: Callable[[GraphInstance], None]  # the runtime's
    replay_plain: Callable[..., List[Any]]  # graph.replay_plain
    # a plain graph with one output that lives in its memory, for a partition returning it alone: a frame that is
    # this one call may have it copied straight out (PartitionRunner.leaving)
    copy_out: bool
    # Its replays not yet on the ledger's clocks and in stats(), and how many may wait before the policy is due
    # (catch_up): counting a steady replay is one increment; the clocks are brought up to date where they are read.
    pending: int = 0
    quiet: int = 0
    counted: int = 0  # of the pending, those already in stats()' replay counts (not plain: replay() counts its own)
    armed: bool = False  # replayed by the compiled steady replay until disarmed (its replays then pending here)


class SteadyReplays:
    """One partition's steady records, per parameter set (`records`), and their counting. The partition's keys,
    parameter sets, ledger and releaser are its runner's (runtime/local/runner.py); `runtime` its ModelRuntime."""

    def __init__(self, keys: BankKey, param_sets: ParamSetIdentity, ledger: BankLedger, releaser: GraphReleaser,
                 runtime: Any, runner: Any = None):
        self.keys, self.param_sets, self.ledger, self.releaser, self.runtime = keys, param_sets, ledger, releaser, runtime
        self.records: Dict[int, SteadyReplay] = {}
        # the compiled steady replay of `runner` as a frame's one call (its Python path: runner.leaving), or None
        self.compiled = STEADY_REPLAY.SteadyLeaving(runner, runtime.memory, runtime) \
            if STEADY_REPLAY is not None and runner is not None and compiled_host_path() else None

    def find(self, args: Sequence[Any]) -> Optional[SteadyReplay]:
        """The record this call may replay now (same parameter set and bank key, its fixed inputs where the graph
        reads them, the replay rule allowing it: the graph's memory claim then taken), or None."""
        index = self.param_sets.index
        record = self.records.get(0 if index is None else id(args[index]))
        if record is not None and record.armed:  # the compiled replay fell back: its replays are pending here
            self._disarm(record)
        if record is not None and (
                _is_grad_enabled() is record.grad and _is_inference_mode_enabled() is record.inference
                and not _any_autocast() if record.modes_only else self.keys.of(args) == record.bank_key) \
                and record.addresses_match(args) and not self.runtime.dead \
                and record.replay_blocker(record.pool_blocker) is None:
            return record
        return None

    def after_replay(self, record: SteadyReplay, args: Sequence[Any]) -> None:
        """After a steady replay: in flight for the pool rule, counted (on the ledger's clocks by catch_up, before
        anything reads them), and the versions of the inputs the graph wrote bumped as aot's wrapper would."""
        record.mark_in_flight(record.graph)
        record.pending += 1
        if record.pending >= record.quiet:
            self.catch_up(record)
        if record.bumped is not None:
            _increment_versions(record.bumped(args))

    def remember(self, graph: GraphInstance, bank_key: tuple, bumped: Optional[Callable[[Sequence[Any]], tuple]],
                 bump_positions: Optional[tuple], usage: Usage, alone: bool) -> None:
        """A direct inference call with `bank_key` replayed `graph`: its parameter set's record from now on.
        `bumped` and `bump_positions`: the arguments whose versions the call bumps, and their positions.
        `alone`: the partition returns the graph's one output by itself (no container)."""
        modes_only = not self.keys.dynamic and not any(bank_key[2:4])
        plain = graph.plain and modes_only and not bank_key[0]
        memory = self.runtime.memory
        outputs = graph.captured.static_outputs
        self.forget(graph.param_set)
        self.records[graph.param_set] = SteadyReplay(
            bank_key, modes_only, bank_key[0], bank_key[1], graph, graph.family, plain, bumped,
            tuple(bump_positions or ()), self.ledger.state(graph.param_set), usage, graph.addresses_match,
            graph.replay_blocker, memory.pool_blocker, memory.mark_in_flight, graph.replay_plain,
            plain and alone and len(outputs) == 1 and memory.owns(outputs[0]))

    def arm(self, record: SteadyReplay) -> None:
        """After a Python steady copy-out replay of `record` (PartitionRunner.leaving): the compiled replay serves
        its next calls while the memory registry's `changes` stays as it is now, for as many replays as may wait
        before the bank policy is due (the one that makes it due runs here, which counts it)."""
        compiled = self.compiled
        limit = record.quiet - record.pending - 1
        if compiled is None or record.armed or limit <= 0:
            return
        graph = record.graph
        index = self.param_sets.index
        compiled.arm(-1 if index is None else index, graph.param_set, record.inference, self.runtime.memory.changes,
                     limit, record.addresses_match, graph.copy_buffers if graph.copied_inputs else None,
                     tuple(graph.copied_inputs), graph.captured, record.bump_positions)
        record.armed = True

    def _disarm(self, record: SteadyReplay) -> None:
        """The compiled replay no longer serves `record`: the replays it made are pending here, as each would be."""
        record.armed = False
        calls = self.compiled.disarm(record.graph.param_set)
        if calls:
            record.pending += calls
            record.graph.replayed_steadily(calls)

    def forget(self, param_set: int) -> None:
        record = self.records.pop(param_set, None)
        if record is not None and record.armed:
            self._disarm(record)

    def clear(self) -> None:
        for record in self.records.values():
            if record.armed:
                self._disarm(record)
        self.records.clear()

    def catch_up(self, record: SteadyReplay) -> None:
        """At a steady replay: count the pending ones (_count), run the policy if it is due, set how many replays
        may wait before it is due again (BankLedger.quiet_calls; sizes are judged only on the full path, which
        counts first)."""
        state = record.state
        if self._count(record) and (state.unjudged or state.calls >= state.next_sweep):
            self.releaser.after_call(record.graph.param_set)
        record.quiet = self.ledger.quiet_calls(state)

    def _count(self, record: SteadyReplay) -> int:
        """Put a record's pending replays on the ledger's clocks and in stats(), as each would have been counted;
        how many. It runs no policy: a count between replays finds none due (pending < quiet)."""
        if record.armed:
            self._disarm(record)
        calls, record.pending = record.pending, 0
        if calls:
            plain, record.counted = calls - record.counted, 0
            add_replays(plain, plain)  # each a steady one: the record was made at a replay after the capture
            self.ledger.steady_replays(record.state, record.usage, record.bank_key, calls)
        return calls

    def count_pending(self) -> None:
        """Bring the clocks and counters up to date before the full path or a reader (stats(), release, a failure,
        the model's end) uses them; each record catches up again at its next replay, as what the caller does next
        may change when the policy is due. Only counts: the policy runs at replays, in the thread that replays."""
        for record in list(self.records.values()):
            self._count(record)
            record.quiet = 0

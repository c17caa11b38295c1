"""The captured instances of one aot graph of a partition's input signature (a `BankEntry`, bank_entry.py): a
`GraphFamily`, forward or inference (backward: backward_family.py): which instance a call replays, when a new one
is captured, the eager warmup before, which outputs are handed out as copies.

aot_autograd splits the partition into functional aten forward and backward graphs; its runtime wrappers keep
doing input mutation copy-back and output aliasing, while our compilers wrap each graph in a GraphFamily that
warms up, captures and replays it through the driver. The partition they belong to (`part`, a PartitionRunner,
runtime/local/runner.py) keeps the bank and the call in progress (runtime/local/call.py); its ledger every counter
(the family reports through the runner's methods); the buffer rules are in runtime/local/instance.py.

Finding an instance costs the same whatever the number of layers or instances: instances are kept per parameter
set (runtime/bank/key.py, the call's `PartitionCall.param_set`), each checks its fixed addresses
in one pass, and the pool rule is tracked incrementally (runtime/local/model_runtime.py).

Outputs kept beyond their step: an eager island's autograd context may keep a partition output as an attribute
(transformers' grouped-mm fallback stores `ctx.offs`), or a caller keeps one across calls (a cache list). Such a
holder would keep the graph held into the next step, and every call would need another instance. So each family
learns which output positions are still referenced at its next call once nothing is pending (its backward ran;
an inference graph has none): during warmup from its eager runs, later from a held instance. Those positions are
then handed out as copies (one device copy each), which the holder may keep as long as it likes.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ... import _compat
from ..memory.arena import OutputLayout, output_layouts
from .budget import refuses_capture
from .instance import GraphInstance, capture_instance
from .sources import source_of, tag
from .staleness import in_place_moved, moved

__all__ = ["EagerHandout", "GraphFamily", "forward_call_of"]

log = logging.getLogger("cgcompile")


def _first_free(instances: Sequence[GraphInstance], args: Sequence[Any], pool_blocker: Callable
                ) -> Tuple[Optional[GraphInstance], List[tuple]]:
    """The first of `instances` whose addresses match `args` that may replay now (or None), and (instance, what
    blocks it) for each matching one before it."""
    blocked = []
    for graph in instances:
        if not graph.addresses_match(args):
            continue
        blocker = graph.replay_blocker(pool_blocker)
        if blocker is None:
            return graph, blocked
        blocked.append((graph, blocker))
    return None, blocked


class EagerHandout:
    """What one eager (warmup) forward run handed out: a weak reference per fresh output storage, and whether its
    backward has run, to learn which positions callers keep beyond their step."""

    def __init__(self, family: "GraphFamily", param_set: int, outputs: Sequence[Any], inputs: Sequence[Any],
                 pending: bool):
        self.family = family
        self.param_set = param_set
        taken = {_compat.storage_key(t)[0] for t in inputs if isinstance(t, torch.Tensor)}
        self.refs = {j: (_compat.storage_key(out)[1], _compat.storage_weak_ref(out)) for j, out in enumerate(outputs)
                     if isinstance(out, torch.Tensor) and _compat.storage_key(out)[0] not in taken}
        self.pending_backward = pending

    def held_positions(self) -> Set[int]:
        return {j for j, (_, ref) in self.refs.items() if not ref.expired()}

    def leaves_frame(self, output: torch.Tensor) -> None:
        """`output` is returned by the compiled frame: the caller holding it is no holder of a replay's output
        (the runtime hands frame outputs out as copies, ModelRuntime.finish_frame_outputs)."""
        handle = _compat.storage_key(output)[1]
        self.refs = {j: entry for j, entry in self.refs.items() if entry[0] != handle}

    def backward_ran(self) -> None:
        self.pending_backward = False


_LESSON_RUN = object()  # the source of a lesson's eager outputs (GraphFamily._forward): a partition reading
# them runs eagerly too, rather than capture an instance for an address it will not see again


def _learn_grads_kept(blocker: GraphInstance, runtime: Any) -> bool:
    """Does backward graph `blocker`, held, show the loop keeps its grads past their step (True: learnt)? Not a
    grad autograd still reads in its pass (a checkpoint's recompute); stolen ones, those of the last replay still
    referenced (learnt as copies), and an output arena's views held after the pass are. Then a loop that keeps one
    backward graph's grads keeps every layer's (grads stolen as .grad kept into the next forward, zero_grad after
    it as in a GAN's generator step; or `torch.autograd.grad`'s results kept for a comparison): each backward
    graph whose grads are held learns it at once. One at a time, each partition would learn it a step after the
    one before it, and every step would capture new instances of the partitions after it (at new addresses)."""
    if not (blocker.steal or not blocker.in_backward_pass and (blocker.family.learn_held(blocker)
                                                               or blocker.hands_out_aliases)):
        return False
    blocker.stop_stealing()
    for graph in runtime.live_graphs():
        if graph.kind == "backward" and not graph.in_backward_pass and graph.held():
            graph.family.learn_held(graph)
            if graph.hands_out_aliases:
                graph.stop_stealing()
    return True


def _lesson_outputs(out: Any, args: Sequence[Any]) -> Any:
    """Tag the fresh outputs of a lesson's eager run (an input passed through keeps its own tag)."""
    passed_through = {id(a) for a in args}
    for t in out:
        if isinstance(t, torch.Tensor) and id(t) not in passed_through:
            tag(t, _LESSON_RUN)
    return out


def forward_call_of(args: Sequence[Any], family: Optional["GraphFamily"]) -> Any:
    """The forward call of `family` (a GraphInstance or an EagerHandout) whose outputs these backward arguments
    are (others may carry the forward calls of the partitions before it: its saved inputs). Once the family knows
    which outputs its backward reads, a replay tags one of them (GraphFamily.marker), not every output."""
    for arg in args:
        source = source_of(arg)
        if source is not None and source is not _LESSON_RUN and source.family is family:
            return source
    return None


class GraphFamily:
    """The captured instances of one aot graph (forward or inference; backward: BackwardFamily) of a BankEntry."""

    def __init__(self, entry: Any, kind: str, run: Callable[[list], Any], mutated: frozenset,
                 collectives: Optional[Dict[str, int]] = None):
        self.entry, self.part, self.kind = entry, entry.part, kind
        self.run = run  # the uncaptured graph (aot graph, or Inductor's compiled version)
        self.mutated = mutated  # inputs the graph itself writes (Inductor keeps some input mutations)
        self.collectives = collectives or {}  # the c10d collectives the graph runs, e.g. DTensor's (stats()["graphs"])
        self.instances: Dict[int, List[GraphInstance]] = {}  # forward/inference instances per parameter set
        self.layouts: Optional[List[OutputLayout]] = None  # its outputs' layouts, seen in an eager run (arenas)
        self.copied_outputs: Set[int] = set()  # output positions callers keep beyond their step: handed out as copies
        self.saved: Set[int] = set()  # forward output positions the backward reads (autograd's saved tensors)
        self.marker: Optional[int] = None  # one of them: the one alias a replay tags (forward_call_of)
        self.moving: Set[int] = set()  # written inputs seen at other addresses: copied in and back
        self._eager: Dict[int, EagerHandout] = {}  # per parameter set, its last warmup run
        self._warmed: Set[int] = set()  # parameter sets this graph ran for on the driver's warmup stream
        self._written: Dict[int, list] = {}  # per parameter set, the written inputs (weakly) of its last warmup

    # calls ---------------------------------------------------------------------------------------------------

    def __call__(self, args: list) -> Any:
        part = self.part
        if part.broken is not None or not part.driver.captures:
            return self.run(args)
        key = part.call.param_set if part.call is not None else 0
        if self._eager:
            self._learn_from_warmup(key)
        if part.warming_up(self, key):
            return self._warmup(key, args)
        out = self._forward(key, args)
        part.releaser.after_call(key)
        return out

    def _watch_written(self, key: int, args: list) -> None:
        """Warmup calls tell whether an input the graph writes is the same tensor every call (read in place once
        captured) or not (copied in and back from the first capture): identity, not address, since a fresh tensor
        may land where the last one was freed."""
        positions = sorted(self.mutated)
        now = [weakref.ref(args[i]) if isinstance(args[i], torch.Tensor) else None for i in positions]
        before = self._written.get(key)
        if before is not None:
            self.moving.update(i for i, a, b in zip(positions, now, before)
                               if a is not None and (b is None or b() is not a()))
        self._written[key] = now

    def _run_warming(self, key: int, args: list) -> Any:
        """An eager run on the driver's warmup stream (per-stream library state then exists before a capture on
        it, so the capture needs no warmup run of its own)."""
        part = self.part
        with part.driver.warmup_stream():  # timed for the benefit rule (runtime/local/benefit.py)
            out = part.benefit.eager(self.kind, self.run_eagerly, args, part.call.args if part.call else ())
        self._warmed.add(key)
        return out

    def run_eagerly(self, args: list) -> Any:
        """The uncaptured graph; for a partition whose sizes vary, its outputs' layouts are noted on the way
        (an output arena is sized before capture, arena.py)."""
        out = self.run(args)
        if self.part.sized and self.layouts is None:
            self.layouts = output_layouts(list(out), args, self.part.runtime.device)
            self.part.arenas.note_layouts(self.kind, self.layouts)
        return out

    def _warmup(self, key: int, args: list) -> Any:
        self._watch_written(key, args)
        out = list(self._run_warming(key, args))
        handout = EagerHandout(self, key, out, args, pending=self.kind == "forward")
        passed_through = {id(a) for a in args}
        for t in out:
            if isinstance(t, torch.Tensor) and id(t) not in passed_through:  # an input returned keeps its own tag
                tag(t, handout)
        self._eager[key] = handout
        return out

    def _forward(self, key: int, args: list) -> Any:
        part = self.part
        graph, lesson = self._replayable(key, args)
        if graph is not None:
            out = part.benefit.replay(graph, args, True, self.copied_outputs)
            part.replayed(graph)
            return out
        stale = self._stale(key, args)
        if stale is not None:
            return self._capture_and_run(key, args, replace=stale[0], reason=stale[1])
        if lesson is None and self.instances.get(key) and any(source_of(a) is _LESSON_RUN for a in args):
            lesson = "upstream lesson"  # input from a lesson's eager run: no address to capture an instance for
        if lesson is not None:  # answered without a new instance: what blocked is handed out as copies from now on
            part.ran_eagerly(lesson=lesson)
            return _lesson_outputs(self.run(args), args)
        if part.stopped is not None:
            part.ran_eagerly()
            return self.run(args)  # stopped capturing new sizes (bank policy); its graphs still replay
        if refuses_capture(part, key, self.kind):  # max_graphs_per_partition, or the memory budget
            return self.run(args)
        return self._capture_and_run(key, args)

    def _replayable(self, key: int, args: list) -> Tuple[Optional[GraphInstance], Optional[str]]:
        """An instance of this parameter set whose addresses match `args` and that may replay now (the one rule,
        GraphInstance.replay_blocker, which the steady replay calls too), or None, with the lesson a blocked one
        taught (_lesson). All blocked: reference cycles are collected and they are looked at again (garbage.py):
        garbage is no reason for another instance, but its lesson stands, so later steps need no collection."""
        runtime, instances = self.part.runtime, self.instances.get(key, ())
        graph, blocked = _first_free(instances, args, runtime.memory.pool_blocker)
        lesson = self._lesson(blocked)  # (from the instances before the one that may replay, if one may)
        if graph is None and blocked and runtime.cycles.collect_for([b for _, b in blocked]):
            graph = _first_free(instances, args, runtime.memory.pool_blocker)[0]
        return graph, (lesson if graph is None else None)

    def _lesson(self, blocked: List[tuple]) -> Optional[str]:
        """What blocked instances teach: held with nothing pending, outputs a caller keeps beyond its step (handed
        out as copies from then on; a later graph held: its family learns it); a backward graph's grads (`.grad`:
        stolen aliases, or static grads in the fresh DTensor AccumulateGrad steals) kept past the step (copied
        from then on). The holder lets go later, so the call runs eagerly rather than capture another instance."""
        lesson = None
        for held, blocker in blocked:
            if blocker is held:
                if self.learn_held(held):
                    lesson = "outputs kept"
            elif blocker.kind == "backward":
                if _learn_grads_kept(blocker, self.part.runtime):
                    lesson = "grads kept"
            elif blocker.family.learn_held(blocker):  # a graph held after this one: a holder its family learns
                lesson = "outputs kept"
        return lesson

    def _stale(self, key: int, args: list) -> Optional[tuple]:
        """(instance, why) when an instance for these very parameter objects is stale (checked on a miss only): a
        parameter moved, or a written input it reads in place comes at another address (copied in and back
        from now on)."""
        for graph in self.all_instances():
            reason = moved(graph, args)
            if reason is not None:
                return graph, reason
        for graph in self.instances.get(key, ()):
            moved_inputs = in_place_moved(graph, args)
            if moved_inputs:
                self.moving.update(moved_inputs)
                return graph, (f"written input(s) {moved_inputs} came at another address: copied in and back from "
                               f"now on instead of written in place")
        return None

    def learn_held(self, graph: GraphInstance) -> bool:
        """A held instance with nothing pending: the positions still referenced are kept beyond the step. True
        when that taught the family positions it did not know."""
        if graph.pending_backward:
            return False
        return self._keep_as_copies(graph.held_positions())

    def _learn_from_warmup(self, key: int) -> None:
        handout = self._eager.get(key)
        if handout is not None and not handout.pending_backward:
            del self._eager[key]
            self._keep_as_copies(handout.held_positions())

    def _keep_as_copies(self, positions: Set[int]) -> bool:
        new = positions - self.saved - self.copied_outputs
        if not new:
            return False
        self.copied_outputs |= new
        self.part.copies_outputs(self.kind, sorted(new))
        return True

    def _capture_and_run(self, key: int, args: list, replace: Optional[GraphInstance] = None,
                         reason: str = "") -> Any:
        part = self.part
        streak = 0
        if replace is not None:
            self.remove(replace)
            streak, storm = part.releaser.recapture(replace, self.kind, reason)
            if storm is not None:
                part.fail(storm, storm=True)
                part.ran_eagerly()  # the call is counted like any other that ran eagerly
                return self.run(args)
        call_args = part.call.args if part.call is not None else ()
        try:
            graph = self._capture(key, args, frozenset(part.inputs.static_storages(call_args)))
        except Exception as exc:
            part.fail(f"capturing its {self.kind} graph failed: {type(exc).__name__}: {exc}")
            part.ran_eagerly()
            return self.run(args)
        runtime = part.runtime
        graph.remember_params(args, lambda dead: runtime.note_dead(part, dead))
        self.instances.setdefault(key, []).append(graph)
        out = graph.replay(args, alias=True, copied_outputs=self.copied_outputs)
        part.captured(graph, streak)
        part.runtime.captured_within_budget(part)  # its real bytes, against cuda_graph_memory_budget
        return out

    def remove(self, graph: GraphInstance) -> None:
        """Forget a forward/inference instance (released or stale; the runtime gives its memory back)."""
        for instances in self.instances.values():
            if graph in instances:
                instances.remove(graph)

    def forget(self, graph: GraphInstance) -> None:
        """Forget a released graph of this family: a forward/inference instance, or a backward graph alone (the
        forward instance owning it captures it again when its backward next runs)."""
        if self.kind == "backward":
            forward = self.entry.forward
            if forward is not None:
                forward.drop_backward(graph)
        else:
            self.remove(graph)

    def owner_of(self, backward_args: Sequence[Any]) -> Optional[GraphInstance]:
        """The forward instance whose memory holds these saved tensors, when no alias object carried it."""
        runtime = self.part.runtime
        for arg in backward_args:
            if isinstance(arg, torch.Tensor):
                graph = runtime.memory.owner(arg)
                if isinstance(graph, GraphInstance) and graph.family is self:
                    return graph
        return None

    def pending_eager_run(self) -> Optional[EagerHandout]:
        """For a backward whose saved tensors name no forward call (its forward saved only its inputs and
        parameters): the latest warmup run still pending, taken as its forward (each backward of a step marks one,
        so all are marked by the next step, when they are read); None when none is pending."""
        return next((h for h in reversed(list(self._eager.values())) if h.pending_backward), None)

    def note_saved(self, instance: GraphInstance, backward_args: Sequence[Any]) -> None:
        """Learn, once, which forward outputs the backward reads: autograd frees them after the backward, so they
        are never copies (a held one means a pending backward)."""
        if self.saved:
            return
        handed = {id(alias): j for j, alias in enumerate(instance.handed_aliases())}
        self.saved = {handed[id(arg)] for arg in backward_args if id(arg) in handed}
        self.marker = min(self.saved) if self.saved else None

    def _capture(self, key: int, args: list, param_storages: frozenset,
                 forward: Optional[GraphInstance] = None) -> GraphInstance:
        part = self.part
        name = forward.label.rsplit(" ", 1)[0] if forward is not None else part.inputs.graph_name(args, param_storages)
        arenas = part.arenas.group(self.kind, param_storages) if part.sized else None
        call_args = part.call.args if part.call is not None else ()
        graph = capture_instance(self, part.name, f"{name} {self.kind}", self.kind, self.run, args, param_storages,
                                 self.mutated, key, part.runtime, part.driver,
                                 part.inputs.input_names_of(args, call_args), arenas,
                                 self.layouts, part.arenas.reserve(self.kind, self.layouts, self.entry.batch),
                                 warmed_up=key in self._warmed, moving=frozenset(self.moving))
        if arenas is not None:
            part.releaser.retire_superseded(arenas)
        return graph

    def all_instances(self) -> List[GraphInstance]:
        return [graph for instances in self.instances.values() for graph in instances]

    def discard(self) -> None:
        for graph in self.all_instances():
            self.part.runtime.discard(graph)
        self.instances = {}

    def drop_backward(self, bw: GraphInstance) -> None:
        """Forget the backward graph `bw` of whichever of these forward instances owns it (captured again later)."""
        for graph in self.all_instances():
            if graph.bw is bw:
                graph.attach_backward(None)

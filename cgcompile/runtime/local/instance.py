"""One captured graph (`GraphInstance`) and the buffer rules it implements: how each argument of a call reaches
the graph's static inputs, what a replay hands out, when a graph is held, when a backward's grads may be stolen.

`capture_instance` classifies each argument and captures through the driver; runtime/local/family.py picks the instance a
call replays; ModelRuntime (runtime/local/model_runtime.py) keeps the registry of which graph owns which memory, the live graphs
and the pool rule. The buffer rules, in one place:

- Static inputs (parameters, buffers) are never copied: their address is recorded at capture and checked at
  replay (one pass over the addresses); a moved one re-captures (counted in stats()["recaptures"]). Other
  parameters altogether (Dynamo reuses one compiled frame for every layer when layers graph-break) get graphs of
  their own, found by the address of the partition's first parameter.
- An input living in memory owned by another captured graph (the previous partition's output, the saved
  activations a backward receives) is *borrowed*: no copy, and the graph only replays for that same address.
- An input the graph writes (a KV cache passed as an argument; Inductor keeps some input mutations in its graphs)
  is read and written *in place*: no copy in, none back; its address is checked like a parameter's. Once its
  address is seen to change between calls (an activation written in place), its family copies it in and back
  instead (runtime/local/family.py).
- Everything else is copied into a static buffer owned by the graph, all in one call.
- Forward/inference outputs are handed out as fresh aliases (`detach()`), never the static tensors: autograd
  attaches grad_fn to the returned objects, so one object reused across calls would corrupt the earlier call's
  graph. A graph is *held* while an alias from its last replay is alive (saved for backward, kept by the caller)
  or anything else references its memory (runtime/memory/claim.py). A held graph is never replayed; the call uses another
  *instance* (captured on demand, like Megatron's per-microbatch graphs), which is what makes fwd, fwd, bwd, bwd
  correct. Output positions callers keep beyond their step are handed out as copies instead (runtime/local/family.py
  learns which), so such a caller holds no graph.
- A backward graph belongs to one forward instance: autograd hands the backward the very alias objects the
  forward replay returned (they carry their graph); it is captured at that instance's first backward. Since a
  held instance never replays, an instance has at most one pending backward.
- Backward outputs: returned as the held static tensors themselves, AccumulateGrad cannot steal one as
  `param.grad` and clones it (a kernel per parameter per step, which eager does not pay); the next backward nodes
  read them, so the graph counts as held until the backward pass ends. So once a backward
  graph has seen its parameters' grads cleared (`zero_grad(set_to_none=True)`) before two replays in a row,
  it hands out aliases instead, which AccumulateGrad steals: `param.grad` is then the graph's memory, and the
  graph (with its forward instance, and under the pool rule every graph before it in the pool) stays held until
  the grads are released. A loop that keeps grads (accumulation, `set_to_none=False`) never gets there, and
  one found keeping them after stealing began turns stealing off for that graph.
- A partition whose input sizes vary writes the outputs of its graphs for different sizes into shared memory,
  an output arena (arena.py): such a graph is also held while its arena is, and its backward always hands out
  aliases (autograd may hold a returned grad in an input buffer while another size's backward runs).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ... import _compat
from ...counters import add_replays
from ..memory.arena import ArenaGroup, OutputArena, OutputLayout, output_layouts, span_bytes, writing_into
from ..drivers.base import CaptureError, CapturedGraph, Driver
from ..drivers.thread_state import preserved_global_state
from ..tensors import at_positions, copy_into, flagged_parameter, static_copy, storage_ptr, uncopyable_reason
from ..memory.claim import MemoryClaim
from ..drivers.write_undo import WriteUndo
from .sources import tag_handout
from .zero_grads import ZeroCopyIn

_copy_all = _compat.copy_all

# How a call argument reaches a graph's static input (ARENA: not an argument, the output arena's views).
CONST, PARAM, BORROWED, IN_PLACE, OWNED, ARENA = "const", "param", "borrowed", "in_place", "owned", "arena"
_FIXED = (PARAM, BORROWED, IN_PLACE)  # read where they are: the address must match


# --- one captured graph --------------------------------------------------------------------------------------


class GraphInstance:
    """One captured graph, and how each argument of a call reaches its static inputs.

    `family` is the GraphFamily (runtime/local/family.py) that captured it; `partition` (the partition's name), `label`
    (unique, readable) and `kind` ("forward", "backward", "inference") name it in logs and stats()["graphs"];
    `param_set` is the parameter set it serves (runtime/bank/key.py). Its memory (`claim`, runtime/memory/claim.py) is
    claimed by itself (claim_owned) and recorded by the runtime's memory registry; borrowers through
    borrow()/forget(). `arena`: the output arena it writes into (a partition whose sizes vary), or None."""

    def __init__(self, family: Any, partition: str, label: str, kind: str, captured: CapturedGraph, kinds: List[str],
                 param_storages: frozenset, capture_seconds: float, param_set: int, mutated: frozenset = frozenset(),
                 arena: Optional[OutputArena] = None):
        self.family, self.partition, self.label, self.kind, self.param_set = family, partition, label, kind, param_set
        self.captured: Optional[CapturedGraph] = captured
        self.kinds, self.param_storages, self.capture_seconds = kinds, param_storages, capture_seconds
        inputs = captured.static_inputs
        fixed = [i for i, k in enumerate(kinds) if k in _FIXED]
        # addresses_match(args): are the parameters, borrowed and in-place inputs where this graph reads them?
        self.addresses = _compat.AddressCheck(fixed, [inputs[i].data_ptr() for i in fixed])
        self.addresses_match = self.addresses.matches
        owned = [i for i, k in enumerate(kinds) if k is OWNED]
        self.copy_back = [i for i in owned if i in mutated]  # written by the graph: the caller's tensor gets it
        self.in_place = [i for i, k in enumerate(kinds) if k is IN_PLACE]
        self.expanded_inputs = [i for i in owned if 0 in inputs[i].stride()]  # copied in by their core
        # copied in, all in one call; an empty one (HF's empty cache tensors) holds no data: nothing to copy
        self.copied_inputs = [i for i in owned if i not in self.expanded_inputs and inputs[i].numel()]
        self.copy_buffers = [inputs[i] for i in self.copied_inputs]
        # the call's arguments at self.copied_inputs, as a sequence, in one C call
        self._copy_sources = at_positions(self.copied_inputs)
        # a backward's copy in when given the frame's zeros (zero_grads.py)
        self.copy_in_but_zeros = ZeroCopyIn.of(inputs, self.copied_inputs, captured.static_outputs) \
            if kind == "backward" else None
        self.tensor_outputs = [j for j, t in enumerate(captured.static_outputs) if isinstance(t, torch.Tensor)]
        self.all_tensors = len(self.tensor_outputs) == len(captured.static_outputs)
        # replay_plain serves it under no_grad: an inference graph whose every input is copied in or read in place,
        # none written back, whose outputs are all tensors, with no output arena
        self.plain = (kind == "inference" and self.all_tensors and not self.expanded_inputs
                      and not self.copy_back and arena is None)
        self.claim = MemoryClaim()
        self.lenders: List[Tuple[MemoryClaim, int, int]] = []  # (lender's claim, storage ptr, references we keep)
        self.pool_position: Optional[int] = None
        self.arena = arena
        self.replays = 0
        self.bw: Optional[GraphInstance] = None  # a forward instance's backward graph
        self.pending_backward = False  # forward: replayed, its backward not run yet
        self.in_backward_pass = False  # backward: handed out aliases of its memory in the backward pass running now
        self.pass_aliases: List[Any] = []  # backward: those aliases, referenced by us until that pass ends
        self.cleared_streak = 0  # backward: replays in a row that found the parameters' grads cleared
        self.grads_kept = False  # backward: a grad it handed out as .grad was kept past its step: copies for good
        self.moved_in_pool = False  # backward: captured again after a graph held at its replays (never again)
        self.param_refs: Dict[int, weakref.ref] = {}  # the caller's parameter objects: moved, or freed?

    # memory registry (runtime/memory/registry.py) -------------------------------------------------------

    def claim_owned(self) -> List[int]:
        """Claim the storages this graph owns (owned_storages; baselines: settle()): their addresses."""
        found = owned_storages(self)
        for ptr, handle, reachable in found:
            self.claim.own(ptr, handle, reachable)
        return [ptr for ptr, _, _ in found]

    def borrow(self, lender: MemoryClaim, ptr: int, kept: int) -> None:
        """This graph keeps `kept` references to memory `lender` claims: they count as the lender's idle state."""
        lender.keep(ptr, kept)
        self.lenders.append((lender, ptr, kept))

    def settle(self, pool_position: Optional[int]) -> None:
        """After capture, nothing handed out yet: the current use counts are the graph's own references."""
        self.claim.settle()
        self.pool_position = pool_position

    def forget(self) -> Optional["GraphInstance"]:
        """Give up every memory claim (re-capture, fallback, release) so the storage can be freed. Returns the
        backward graph that belonged to this instance, for the runtime to forget too."""
        for lender, ptr, kept in self.lenders:
            lender.keep(ptr, -kept)
        bw, self.bw = self.bw, None
        if self.arena is not None:
            self.arena.leave(self)
        self.lenders, self.claim, self.captured = [], MemoryClaim(), None
        return bw

    @property
    def alive(self) -> bool:
        """Still captured (not discarded): its memory claims count."""
        return self.captured is not None

    # use -----------------------------------------------------------------------------------------------------

    def remember_params(self, args: Sequence[Any], on_death: Callable[["GraphInstance"], None]) -> None:
        """Keep weak references to the caller's parameter objects: to tell "moved" from "another layer's", and
        to hear when one is freed (load_state_dict(assign=True)): `on_death(graph)` then releases it at once."""
        me = weakref.ref(self)

        def freed(_: Any) -> None:
            graph = me()
            if graph is not None and graph.alive:
                on_death(graph)

        # (a tensor flagged as a parameter without being one is made anew on every call: its storage is what is read)
        self.param_refs = {i: weakref.ref(args[i], freed) for i, k in enumerate(self.kinds)
                           if k is PARAM and not flagged_parameter(args[i])}

    def handed_aliases(self) -> List[Optional[torch.Tensor]]:
        """The aliases its last replay handed out, by output position (None where dead or copied)."""
        return self.claim.aliases()

    def attach_backward(self, bw: Optional["GraphInstance"]) -> None:
        self.bw = bw

    def backward_ran(self) -> None:
        """Its backward ran (replayed or eagerly): nothing of its last replay is pending any more."""
        self.pending_backward = False

    def note_grads(self, cleared: bool) -> None:
        """Backward: before this replay the parameters' grads were (not) cleared; two in a row enable stealing."""
        self.cleared_streak = self.cleared_streak + 1 if cleared else 0

    def stop_stealing(self) -> None:
        """The loop keeps a grad it was given past its step (accumulation, `g = p.grad` in a logger): backward
        outputs are copied from now on, for good (a kept grad then holds no graph memory)."""
        self.cleared_streak = 0
        self.grads_kept = True

    def replaces_in_pool(self, old: "GraphInstance") -> None:
        """Backward: captured again, after the graph that held `old` at its replays (runtime/local/family.py). It
        keeps what `old` learnt of the loop's grads, and is not moved again (a loop no capture order suits then
        runs it eagerly, as before)."""
        self.cleared_streak, self.grads_kept, self.moved_in_pool = old.cleared_streak, old.grads_kept, True

    @property
    def steal(self) -> bool:
        """Backward: hand out aliases AccumulateGrad may keep as .grad (grads seen cleared twice, never kept)."""
        return self.cleared_streak >= 2 and not self.grads_kept

    @property
    def hands_out_aliases(self) -> bool:
        """Backward: are its grads handed out as aliases AccumulateGrad may keep as .grad? Stolen ones (`steal`), and
        an output arena's (memory shared with other sizes, whose lives the arena sees), until one is found kept."""
        return self.steal or (self.arena is not None and not self.grads_kept)

    def held_by_itself(self) -> bool:
        """Is this graph's own memory in use (held() without the output arena it shares)? What a release asks: a
        member of an arena another size's output holds may go, the arena staying with its other members (and a
        held arena is never written: no member replays into it, and a new capture takes another)."""
        return self.in_backward_pass or self.claim.held()

    def held(self) -> bool:
        """Is this graph's memory, or the output arena it shares with other sizes (arena.py), in use?"""
        return self.in_backward_pass or self.claim.held() or (self.arena is not None and self.arena.held())

    def replay_blocker(self, pool_blocker: Callable[["GraphInstance"], Optional["GraphInstance"]]
                       ) -> Optional["GraphInstance"]:
        """The one rule for "may this instance replay now", which the family's full path and the runner's steady
        replay both call: None when it may; else what stops it: the instance itself (discarded, or its memory in
        use), its backward graph (the grads it handed out as .grad still in use), or a later graph in the pool
        that is held (`pool_blocker`, the runtime's pool rule). A plain graph's memory test also takes its claim
        for the replay about to run (MemoryClaim.take)."""
        if self.captured is None:
            return self
        if self.plain:
            if not self.claim.take():
                return self
        elif self.held():
            return self
        bw = self.bw
        if bw is not None and bw.held():
            return bw
        return pool_blocker(self)

    def held_positions(self) -> Set[int]:
        """Output positions of the last replay still in use: an alias alive, or a view of its storage."""
        storages = self.claim.held_storages()
        outputs = self.captured.static_outputs if self.captured is not None else []
        return set(self.claim.alive_aliases()) | {
            j for j, out in enumerate(outputs) if isinstance(out, torch.Tensor) and storage_ptr(out) in storages}

    def _held_until_backward_ends(self, aliases: List[Any]) -> None:
        """A backward graph handed out aliases of its memory in the backward pass running now, which we reference
        until it ends: AccumulateGrad steals a grad only when nobody else references it, so it copies these into
        .grad; whatever else keeps one (`torch.autograd.grad`'s result, a hook that stores its grad) holds the
        memory through its storage's use count from then on, which the next replay's check sees."""
        me = weakref.ref(self)

        def ended() -> None:
            graph = me()
            if graph is not None:
                graph.in_backward_pass = False
                graph.pass_aliases = []

        self.in_backward_pass = True
        self.pass_aliases = aliases
        _compat.at_backward_end(ended)

    def replay_plain(self, args: Sequence[Any], copy_out: bool = False) -> List[Any]:
        """replay(args, alias=True) for a `plain` graph with no output handed out as a copy, whose memory claim the
        caller has just taken (replay_blocker): the steady inference replay (runtime/local/steady.py) without the
        branches it never takes. `copy_out`: its one output, in its memory, leaves the frame at once, copied
        (PartitionRunner.leaving): no alias made only to be cloned, and nothing of this memory handed out."""
        if self.copied_inputs:  # one dispatch (a caller passing our own buffer back copies it onto itself: a no-op)
            _copy_all(self.copy_buffers, self._copy_sources(args))
        static = self.captured.replay()  # held while an alias lives: use counts tell
        self.replays += 1  # counted in stats() by the caller when it brings its clocks up to date (add_replays)
        if copy_out:
            self.claim.handed_nothing()
            return [static[0].clone()]
        return [static[0].detach()] if len(static) == 1 else [out.detach() for out in static]

    def replayed_steadily(self, calls: int) -> None:
        """`calls` replays the compiled steady replay made (runtime/local/steady.py), counted when it hands over."""
        self.replays += calls

    def replay(self, args: Sequence[Any], alias: bool, copied_outputs: Set[int] = frozenset()) -> List[Any]:
        """Run the graph for `args`: outputs handed out as aliases (or, at positions in `copied_outputs`, as
        copies); when not `alias` (a backward's grads that AccumulateGrad is to copy), as aliases we reference
        until the backward pass ends.
        Every replay runs this: each step is one that a replay needs."""
        grad = torch.is_grad_enabled()
        if grad:  # copies into our buffers and the aliases handed out carry no autograd history
            _compat.set_grad_enabled(False)
        try:
            # one dispatch (a caller passing our own buffer back copies it onto itself); a backward given zeros
            # for an output without a gradient leaves those out where its buffer holds zeros (zero_grads.py)
            if self.copied_inputs and not (self.copy_in_but_zeros is not None and self.copy_in_but_zeros(args)):
                _copy_all(self.copy_buffers, self._copy_sources(args))
            for i in self.expanded_inputs:
                copy_into(self.captured.static_inputs[i], args[i])
            static = self.captured.replay()
            for i in self.copy_back:
                args[i].copy_(self.captured.static_inputs[i])
            if self.arena is not None:
                self.arena.replayed()
            if alias and self.kind == "forward":  # the backward finds its instance by a tagged alias it saved
                if self.all_tensors and not copied_outputs:  # the usual training forward
                    outputs = handed = [out.detach() for out in static]
                else:
                    outputs, handed = list(static), [None] * len(static)
                    for j in self.tensor_outputs:
                        outputs[j] = outputs[j].clone() if j in copied_outputs else outputs[j].detach()
                        handed[j] = None if j in copied_outputs else outputs[j]
                tag_handout(handed, self, self.family.marker)
                self.claim.hand_out(handed)
            else:  # held while an alias lives: its storage's use count tells
                if self.all_tensors and not copied_outputs:  # the usual inference or backward replay
                    outputs = [out.detach() for out in static]
                else:  # copies: outputs (or grads) kept past their step
                    outputs = list(static)
                    for j in self.tensor_outputs:
                        outputs[j] = outputs[j].clone() if j in copied_outputs else outputs[j].detach()
                self.claim.replayed()
                if not alias:  # grads for AccumulateGrad to copy: referenced by us until the backward pass ends
                    self._held_until_backward_ends(outputs)
        finally:
            if grad:
                _compat.set_grad_enabled(True)
        self.replays += 1
        self.pending_backward = self.kind == "forward"
        add_replays(1, self.replays > 1)
        return outputs


# --- what a graph holds --------------------------------------------------------------------------------------


def memory_of(graph: GraphInstance, saved: Set[int] = frozenset()) -> Dict[str, Any]:
    """Bytes this graph holds: its pool reservation, its copied-in input buffers, its own outputs (of which
    `saved_output_bytes` live in storages the backward reads: `saved` output positions, what eager also holds
    between forward and backward); and the output arena it shares (once per arena in a total), with the bytes of
    it its outputs take."""
    inputs = graph.captured.static_inputs
    nbytes = {storage_ptr(t): t.untyped_storage().nbytes() for t in inputs if isinstance(t, torch.Tensor)}
    buffers = sum(nbytes[storage_ptr(t)] for t, k in zip(inputs, graph.kinds) if k is OWNED)
    outputs = {storage_ptr(t): t.untyped_storage().nbytes() for t in graph.captured.static_outputs
               if isinstance(t, torch.Tensor) and storage_ptr(t) not in nbytes}
    saved_storages = {storage_ptr(t) for j, t in enumerate(graph.captured.static_outputs)
                      if j in saved and isinstance(t, torch.Tensor)}
    arena = graph.arena
    return {"pool_bytes": graph.captured.pool_bytes, "static_input_bytes": buffers,
            "static_output_bytes": sum(outputs.values()),
            "saved_output_bytes": sum(n for ptr, n in outputs.items() if ptr in saved_storages),
            "arena": arena.name if arena is not None else None,
            "arena_bytes": arena.nbytes if arena is not None else 0,
            "arena_output_bytes": sum(span_bytes(t) for t, k in zip(inputs, graph.kinds) if k is ARENA)}


def owned_storages(graph: GraphInstance) -> List[Tuple[int, int, bool]]:
    """Storages this graph owns: its copied-in input buffers and outputs not aliasing other inputs, as
    (ptr, handle, reachable): reachable when an output lives in it (what a caller can reference)."""
    inputs = graph.captured.static_inputs
    foreign = {storage_ptr(t) for t, k in zip(inputs, graph.kinds) if k in (PARAM, BORROWED, IN_PLACE, ARENA)}
    found: Dict[int, int] = {}
    candidates = [t for t, k in zip(inputs, graph.kinds) if k is OWNED] + list(graph.captured.static_outputs)
    for t in candidates:
        if isinstance(t, torch.Tensor):
            ptr, sid = _compat.storage_key(t)
            if ptr and ptr not in foreign:
                found.setdefault(ptr, sid)
    reachable = {storage_ptr(t) for t in graph.captured.static_outputs if isinstance(t, torch.Tensor)}
    return [(ptr, sid, ptr in reachable) for ptr, sid in found.items()]


# --- capture ------------------------------------------------------------------------------------------------


def capture_instance(family: Any, partition: str, label: str, kind: str, run: Callable[[list], Any], args: list,
                     param_storages: frozenset, mutated: frozenset, param_set: int, runtime: Any, driver: Driver,
                     names: Sequence[Optional[str]] = (), arenas: Optional[ArenaGroup] = None,
                     layouts: Optional[List[OutputLayout]] = None, reserve: Optional[Dict[int, int]] = None,
                     warmed_up: bool = False,
                     moving: frozenset = frozenset()) -> GraphInstance:
    """Capture `run` for `args` as a new instance and register it with `runtime` (the ModelRuntime): each
    argument becomes a constant, a parameter or in-place input read where it is, a borrowed input or a copied-in
    owned buffer. `names` (per argument, where known) say in a CaptureError which user value an argument is. With
    `arenas` (a partition whose sizes vary) its fresh outputs go into an output arena of that group (arena.py);
    `layouts` are its outputs' layouts when known (else one eager run finds them); `reserve`, bytes per output
    position a new arena holds at least (the largest sizes seen or declared, so they need no larger one later). `warmed_up`: the caller ran the
    graph eagerly on the driver's warmup stream already, so the driver needs no warmup run of its own. `moving`:
    written inputs seen at other addresses before, copied in and back rather than read in place."""
    lenders = runtime.memory.lenders(args)
    kinds: List[str] = []
    inputs: List[Any] = []
    for index, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            kinds.append(CONST)
            inputs.append(arg)
            continue
        # Inputs read in place are held as detached aliases: the graph needs their memory, not their autograd
        # history (holding a caller's tensor would keep its whole autograd graph alive).
        ptr = storage_ptr(arg)
        if ptr and ptr in param_storages:
            kinds.append(PARAM)
            inputs.append(arg.detach())
        elif ptr and runtime.memory.owner(arg) is not None:
            kinds.append(BORROWED)
            inputs.append(arg.detach())
        elif index in mutated and index not in moving:
            kinds.append(IN_PLACE)
            inputs.append(arg.detach())
        else:
            kinds.append(OWNED)
            inputs.append(static_buffer(arg, index, names[index] if index < len(names) else None))
    arena = None
    if arenas is not None:
        if layouts is None:
            layouts = _probe_layouts(run, inputs, runtime.device, mutated)
        arena = arenas.place(family, layouts, runtime.device, reserve or {})
    fn, before = run, {}
    if arena is not None:  # its views become static inputs after the arguments; the graph copies into them
        before = arena.claim.use_counts()
        placed = arena.views(layouts)
        fn = writing_into(run, [j for j, _ in placed], len(inputs))
        kinds += [ARENA] * len(placed)
        inputs += [view for _, view in placed]
        del placed
    start = time.perf_counter()
    captured = driver.capture(fn, inputs, runtime.pool(), warmup=not warmed_up, written=sorted(mutated))
    seconds = time.perf_counter() - start
    graph = GraphInstance(family, partition, label, kind, captured, kinds, param_storages, seconds, param_set, mutated,
                          arena)
    del inputs, captured
    runtime.register(graph, lenders)
    if arena is not None:
        arena.join(family, graph, before)
    return graph


def _probe_layouts(run: Callable[[list], Any], inputs: List[Any], device: torch.device,
                   written: frozenset) -> List[OutputLayout]:
    """Run the graph once eagerly to learn its outputs' layouts (an arena is sized before capture), leaving
    random generators and the inputs it writes as they were."""
    undo = WriteUndo([inputs[i] for i in written])
    with preserved_global_state(rng=True), torch.no_grad(), undo:
        outputs = list(run(list(inputs)))
    layouts = output_layouts(outputs, inputs, device)
    del outputs
    undo.restore()
    return layouts


# --- static input buffers, written inputs --------------------------------------------------------------------


def static_buffer(t: torch.Tensor, index: int, name: Optional[str] = None) -> torch.Tensor:
    """A copy of t with t's exact layout (expanded, strided, offset or empty), owned by a graph."""
    reason = uncopyable_reason(t)
    if reason is not None:
        raise CaptureError(f"{name or f'input {index}'} cannot be copied into a static buffer: {reason}")
    with torch.no_grad():
        return static_copy(t)

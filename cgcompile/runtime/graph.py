"""One captured graph (`GraphInstance`) and the buffer rules it implements: how each argument of a call reaches
the graph's static inputs, what a replay hands out, when a graph is busy, when a backward's grads may be stolen.

`capture_instance` classifies each argument, captures through the driver and restores inputs the capture wrote;
graph_family.py picks the instance a call replays; ModelRuntime (model_runtime.py) keeps the registry of which
graph owns which memory, the live graphs, and the pool rules. The buffer rules, in one place:

- Static inputs (parameters, buffers) are never copied: their address is recorded at capture and checked at
  replay; a moved one re-captures (counted in stats()["recaptures"]). Other parameters altogether (Dynamo
  reuses one compiled frame for every layer when layers graph-break) get graphs of their own.
- An input living in memory owned by another captured graph (the previous partition's output, the saved
  activations a backward receives) is *borrowed*: no copy, and the graph only replays for that same address.
- Everything else is copied into a static buffer owned by the graph (skipped when it is already there).
- Forward/inference outputs are handed out as fresh aliases (`detach()`), never the static tensors: autograd
  attaches grad_fn to the returned objects, so one object reused across calls would corrupt the earlier
  call's graph. A graph is *busy* while an alias from its last replay is alive (saved for backward, held by
  the caller) or anything else outside the runtime references its memory (a view or `.detach()` copy,
  seen through storage use counts). A busy graph is never replayed; the call uses another *instance* of it
  (captured on demand, like Megatron's per-microbatch graphs), which is what makes fwd, fwd, bwd, bwd
  correct. Instances count against `max_graphs_per_partition` (per parameter set, i.e. per layer); past it
  the call runs eagerly.
- A backward graph belongs to one forward instance: autograd hands the backward the very alias objects the
  forward replay returned (they carry their graph), else memory only that instance owns identifies it; it
  is captured at that instance's first backward. Since a busy instance never replays, an instance has at
  most one pending backward.
- Backward outputs: returned as the held static tensors themselves, AccumulateGrad cannot steal one as
  `param.grad` and clones it (a kernel per parameter per step, which eager does not pay). So once a backward
  graph has seen its parameters' grads cleared (`zero_grad(set_to_none=True)`) before two replays in a row,
  it hands out aliases instead, which AccumulateGrad steals: `param.grad` is then the graph's memory, and the
  graph (with its forward instance, and under the pool rule every earlier shared-pool graph) stays busy until
  the grads are released. A loop that keeps grads (accumulation, `set_to_none=False`) never gets there, and
  one that keeps them after stealing began turns stealing off for that graph (the call that found the grads
  held takes another instance or runs eagerly; if they are never released, e.g. `set_to_none=False` from
  then on, that instance stays unused, its memory being `.grad`).
- Inputs the graph itself writes (Inductor keeps some input mutations in its graphs) are restored after
  capture, which runs the graph once, and copied back to the caller's tensor after each replay.
- A partition whose input sizes vary writes the outputs of its graphs for different sizes into shared memory,
  an output arena (arena.py): such a graph is also busy while its arena is, and its backward always hands out
  aliases (autograd may hold a returned grad in an input buffer while another size's backward runs).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from .. import _compat
from ..counters import add as count
from ..passes.common import written_args
from .arena import ArenaGroup, OutputArena, OutputLayout, output_layouts, span_bytes, writing_into
from .driver import CaptureError, CapturedGraph, Driver
from .global_state import preserved_global_state
from .layout import copy_into, same_repeats, static_copy, uncopyable_reason

log = logging.getLogger("cgcompile")

# How a call argument reaches a graph's static input (ARENA: not an argument, the output arena's views).
CONST, PARAM, BORROWED, OWNED, ARENA = "const", "param", "borrowed", "owned", "arena"
MISMATCH = object()  # match(): this graph was captured for other addresses/values; try another instance


def is_static_tensor(arg: Any) -> bool:
    """A parameter or buffer seen at run time: nn.Parameter, or a tensor Dynamo marked static (it marks module
    buffers too). Their addresses stay fixed between calls, so graphs read them in place."""
    return isinstance(arg, torch.nn.Parameter) or (
        isinstance(arg, torch.Tensor) and hasattr(arg, "_dynamo_static_input_type"))


def storage_ptr(t: torch.Tensor) -> int:
    """The address of t's storage (0 for a storage without memory): the key of the memory registry."""
    return _compat.storage_key(t)[0]


# --- one captured graph --------------------------------------------------------------------------------------


class GraphInstance:
    """One captured graph, and how each argument of a call reaches its static inputs.

    `owner` is whatever captured it (a GraphFamily, graph_family.py: used to tell its instances apart),
    `partition` (the partition's name), `label` (its description) and `kind` ("forward", "backward",
    "inference") name it in logs and stats()["graphs"]. Its
    fields are written here only; ModelRuntime records ownership through own()/lend()/forget()."""

    def __init__(self, owner: Any, partition: str, label: str, kind: str, captured: CapturedGraph, kinds: List[str],
                 param_storages: frozenset, capture_seconds: float, mutated: frozenset = frozenset()):
        self.owner = owner
        self.partition = partition
        self.label = label
        self.kind = kind
        self.captured: Optional[CapturedGraph] = captured
        self.kinds = kinds
        self.param_storages = param_storages
        self.capture_seconds = capture_seconds
        inputs = captured.static_inputs
        self.param_ptrs = {i: inputs[i].data_ptr() for i, k in enumerate(kinds) if k is PARAM}
        self.param_refs: Dict[int, weakref.ref] = {}  # the caller's parameter objects, to tell "moved" apart
        # match() runs on every call: the expected address or value per position, computed once here.
        self.param_checks = list(self.param_ptrs.items())
        self.borrow_checks = [(i, inputs[i].data_ptr()) for i, k in enumerate(kinds) if k is BORROWED]
        self.const_checks = [(i, inputs[i]) for i, k in enumerate(kinds) if k is CONST]
        self.copies = [i for i, k in enumerate(kinds) if k is OWNED]
        # an expanded buffer takes only arguments that repeat along the same dimensions
        self.repeat_checks = [(i, inputs[i]) for i in self.copies if 0 in inputs[i].stride()]
        # copied-in inputs the graph writes: the caller's tensor gets the result
        self.copy_back: List[int] = [i for i in sorted(mutated) if kinds[i] is OWNED]
        self.owned: Dict[int, List[int]] = {}  # storage ptr -> [storage handle, use count when idle]
        self.borrowed_from: List[Tuple[GraphInstance, int, int]] = []  # (lender, storage ptr, references we keep)
        self.shared_index: Optional[int] = None
        self.arena: Optional[OutputArena] = None  # where its outputs live, for a partition whose sizes vary
        self.replays = 0
        self.handed: List[weakref.ref] = []  # the aliases the last replay handed out
        self.free = False  # seen idle since its last replay: stays so until the next replay (see busy())
        self.bw: Optional[GraphInstance] = None  # a forward instance's backward graph
        self.cleared_streak = 0  # backward: replays in a row that found the parameters' grads cleared
        # Graph-bank bookkeeping (graph_family.py, partition_runner.py, bank_policy.py): the label without its
        # kind (a backward's label starts with its forward's), the partition's clock at its last use, re-captures
        # in a row.
        self.name = label
        self.last_use = 0
        self.recapture_streak = 0

    # memory registry (ModelRuntime) ----------------------------------------------------------------------

    def own(self, ptr: int, storage_handle: int) -> None:
        """Record that this graph owns the storage at ptr; its idle use count is settled by settle()."""
        self.owned[ptr] = [storage_handle, 0]

    def borrow(self, lender: "GraphInstance", ptr: int, kept: int) -> None:
        """This graph keeps `kept` references to memory `lender` owns: they count as the lender's idle state."""
        lender.owned[ptr][1] += kept
        self.borrowed_from.append((lender, ptr, kept))

    def settle(self, shared_index: Optional[int]) -> None:
        """After capture, nothing handed out yet: the current use counts are the graph's own references."""
        for entry in self.owned.values():
            entry[1] += _compat.storage_use_count(entry[0])
        self.shared_index = shared_index

    def forget(self) -> Optional["GraphInstance"]:
        """Give up every memory claim (re-capture, fallback, release) so the storage can be freed. Returns the
        backward graph that belonged to this instance, for the runtime to forget too."""
        for lender, ptr, kept in self.borrowed_from:
            if ptr in lender.owned:
                lender.owned[ptr][1] -= kept
        bw, self.bw = self.bw, None
        if self.arena is not None:
            self.arena.leave(self)
        self.borrowed_from, self.owned, self.captured = [], {}, None
        return bw

    @property
    def alive(self) -> bool:
        """Still captured (not discarded): its memory claims count."""
        return self.captured is not None

    # use -----------------------------------------------------------------------------------------------------

    def remember_params(self, args: Sequence[Any]) -> None:
        """Keep weak references to the caller's parameter objects, to tell "moved" from "another layer's"."""
        self.param_refs = {i: weakref.ref(args[i]) for i, k in enumerate(self.kinds) if k is PARAM}

    def enter_bank(self, name: str, tick: int, recapture_streak: int = 0) -> None:
        """Taken into a partition's graph bank at its clock's `tick` (see bank_policy.py)."""
        self.name, self.last_use, self.recapture_streak = name, tick, recapture_streak

    def mark_used(self, tick: int) -> None:
        self.last_use = tick

    def attach_backward(self, bw: Optional["GraphInstance"]) -> None:
        self.bw = bw

    def note_grads(self, cleared: bool) -> None:
        """Backward: before this replay the parameters' grads were (not) cleared; two in a row enable stealing."""
        self.cleared_streak = self.cleared_streak + 1 if cleared else 0

    def memory(self) -> Dict[str, int]:
        """Bytes this graph holds: its pool reservation, its copied-in input buffers, its own outputs; and the
        output arena it shares (once per arena in a total), with the bytes of it its outputs take."""
        inputs = self.captured.static_inputs
        nbytes = {_compat.storage_key(t)[0]: t.untyped_storage().nbytes() for t in inputs
                  if isinstance(t, torch.Tensor)}
        buffers = sum(nbytes[storage_ptr(t)] for t, k in zip(inputs, self.kinds) if k is OWNED)
        outputs = {storage_ptr(t): t.untyped_storage().nbytes() for t in self.captured.static_outputs
                   if isinstance(t, torch.Tensor) and storage_ptr(t) not in nbytes}
        arena = self.arena
        return {"pool_bytes": self.captured.pool_bytes, "static_input_bytes": buffers,
                "static_output_bytes": sum(outputs.values()), "arena": arena.name if arena is not None else None,
                "arena_bytes": arena.nbytes if arena is not None else 0,
                "arena_output_bytes": sum(span_bytes(t) for t, k in zip(inputs, self.kinds) if k is ARENA)}

    def owned_storages(self) -> List[Tuple[int, int]]:
        """Storages this graph owns: its copied-in input buffers and outputs not aliasing other inputs."""
        inputs = self.captured.static_inputs
        foreign = {storage_ptr(t) for t, k in zip(inputs, self.kinds) if k in (PARAM, BORROWED, ARENA)}
        found: Dict[int, int] = {}
        candidates = [t for t, k in zip(inputs, self.kinds) if k is OWNED] + list(self.captured.static_outputs)
        for t in candidates:
            if isinstance(t, torch.Tensor):
                ptr, sid = _compat.storage_key(t)
                if ptr and ptr not in foreign:
                    found.setdefault(ptr, sid)
        return list(found.items())

    @property
    def steal(self) -> bool:
        """Backward: hand out aliases that AccumulateGrad may keep as param.grad (grads seen cleared twice)."""
        return self.cleared_streak >= 2

    def busy(self) -> bool:
        """Is this graph, or the output arena it shares with other sizes (arena.py), in use?"""
        return self.busy_alone() or (self.arena is not None and self.arena.busy())

    def busy_alone(self) -> bool:
        """Is an alias from the last replay alive (e.g. saved for a pending backward), or does anything
        besides the runtime still reference this graph's own memory (a view, a `.detach()`ed copy)?

        Once idle, a graph stays idle until its next replay: new references to its memory come only from
        a replay's aliases, or from a borrower replaying on it, which needs a live reference already.
        So the result is cached, which keeps the pool rule's scans cheap.

        A backward graph found busy while it hands out stealable grads stops doing so: the loop keeps the
        grads it was given (see the module docstring).
        """
        if self.free:
            return False
        if any(ref() is not None for ref in self.handed) or any(
                _compat.storage_use_count(sid) > idle for sid, idle in self.owned.values()):
            if self.steal:
                self.cleared_streak = 0
                log.debug("cgcompile: %s: gradients kept across steps; backward outputs are copied from now on",
                          self.label)
            return True
        self.free = True
        return False

    def match(self, args: Sequence[Any]) -> Any:
        """None if this graph can run `args`; else MISMATCH (captured for other addresses, e.g. another
        layer's parameters when Dynamo reuses one compiled frame for every layer), or a reason string when
        one of *its own* static inputs has moved since capture (the graph is stale: re-capture it)."""
        for i, ptr in self.param_checks:
            if args[i].data_ptr() != ptr:
                return self.moved(i) or MISMATCH
        for i, ptr in self.borrow_checks:
            if args[i].data_ptr() != ptr:
                return MISMATCH
        for i, value in self.const_checks:
            arg = args[i]
            if isinstance(arg, torch.Tensor) or arg != value:
                return MISMATCH
        for i, buf in self.repeat_checks:
            if not same_repeats(buf, args[i]):
                return MISMATCH
        return None

    def moved(self, i: int) -> Optional[str]:
        """Why this graph is stale, if the parameter it was captured with at position i now lives elsewhere
        (else the call simply passes another parameter, e.g. another layer's)."""
        ref = self.param_refs.get(i)
        param = ref() if ref is not None else None
        if param is not None and param.data_ptr() != self.param_ptrs[i]:
            return f"static input {i} moved (parameter or buffer re-allocated)"
        return None

    def replay(self, args: Sequence[Any], runtime: Any, alias: bool) -> List[Any]:
        """Run the graph for `args`; `runtime` (the ModelRuntime) is told of the replay (pool wave, summary)."""
        inputs = self.captured.static_inputs
        with torch.no_grad():
            for i in self.copies:
                arg, buf = args[i], inputs[i]
                if arg.data_ptr() != buf.data_ptr():
                    copy_into(buf, arg)
            self.free = False
            if self.arena is not None:
                self.arena.note_replay()
            outputs = list(self.captured.replay())
            for i in self.copy_back:
                if args[i].data_ptr() != inputs[i].data_ptr():
                    args[i].copy_(inputs[i])
            self.handed = []
            if alias:
                outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]
                for out in outputs:
                    if isinstance(out, torch.Tensor):
                        if self.kind != "backward":
                            out._cgcompile_graph = self  # lets the backward find its forward instance
                        self.handed.append(weakref.ref(out))
        count("replays")
        self.replays += 1
        runtime.note_replay(self)
        return outputs


# --- capture ------------------------------------------------------------------------------------------------


def capture_instance(owner: Any, partition: str, label: str, kind: str, run: Callable[[list], Any], args: list,
                     param_storages: frozenset, mutated: frozenset, runtime: Any, driver: Driver,
                     names: Sequence[Optional[str]] = (), arenas: Optional[ArenaGroup] = None,
                     layouts: Optional[List[OutputLayout]] = None) -> GraphInstance:
    """Capture `run` for `args` as a new instance and register it with `runtime` (the ModelRuntime): each
    argument becomes a constant, a parameter read in place, a borrowed input or a copied-in owned buffer.
    `names` (per argument, where known) say in a CaptureError which user value an argument is. With `arenas`
    (a partition whose sizes vary) its fresh outputs go into an output arena of that group (arena.py);
    `layouts` are its outputs' layouts when known (else one eager run finds them)."""
    lenders = runtime.lenders(args)
    kinds: List[str] = []
    inputs: List[Any] = []
    for index, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            kinds.append(CONST)
            inputs.append(arg)
            continue
        # Static and borrowed inputs are held as detached aliases: the graph needs their memory, not
        # their autograd history (holding a caller's tensor would keep its whole autograd graph alive).
        ptr = storage_ptr(arg)
        if ptr and ptr in param_storages:
            kinds.append(PARAM)
            inputs.append(arg.detach())
        elif ptr and runtime.owner(arg) is not None:
            kinds.append(BORROWED)
            inputs.append(arg.detach())
        else:
            kinds.append(OWNED)
            inputs.append(static_buffer(arg, index, names[index] if index < len(names) else None))
    # Capturing runs the graph once (emulate; CUDA's warmup): undo its writes to inputs, or the replay
    # that produces this call's results would apply them a second time.
    with torch.no_grad():
        saved = {i: inputs[i].clone() for i in mutated if isinstance(inputs[i], torch.Tensor)}
    arena = None
    if arenas is not None:
        if layouts is None:
            layouts = _probe_layouts(run, inputs, saved, runtime.device)
        arena = arenas.place(owner, layouts, runtime.device)
    fn, before = run, {}
    if arena is not None:  # its views become static inputs after the arguments; the graph copies into them
        pool, shared = arena.pool, False
        before = arena.use_counts()
        placed = arena.views(layouts)
        fn = writing_into(run, [j for j, _ in placed], len(inputs))
        kinds += [ARENA] * len(placed)
        inputs += [view for _, view in placed]
        del placed
    else:
        pool, shared = runtime.pool()
    start = time.perf_counter()
    captured = driver.capture(fn, inputs, pool)
    seconds = time.perf_counter() - start
    _restore(inputs, saved)
    graph = GraphInstance(owner, partition, label, kind, captured, kinds, param_storages, seconds, mutated)
    graph.arena = arena
    del inputs, captured, saved
    runtime.register(graph, shared, lenders, arena)
    if arena is not None:
        arena.join(owner, graph, before)
    return graph


def _restore(inputs: List[Any], saved: Dict[int, torch.Tensor]) -> None:
    with torch.no_grad():
        for i, value in saved.items():
            inputs[i].copy_(value)


def _probe_layouts(run: Callable[[list], Any], inputs: List[Any], saved: Dict[int, torch.Tensor],
                   device: torch.device) -> List[OutputLayout]:
    """Run the graph once eagerly to learn its outputs' layouts (an arena is sized before capture), leaving
    random generators and the inputs it writes as they were."""
    with preserved_global_state(rng=True), torch.no_grad():
        outputs = list(run(list(inputs)))
    layouts = output_layouts(outputs, inputs, device)
    del outputs
    _restore(inputs, saved)
    return layouts


# --- static input buffers, written inputs --------------------------------------------------------------------


def mutated_inputs(gm: fx.GraphModule) -> frozenset:
    """Positions of gm's inputs that an op in gm writes (per the op schemas' alias annotations)."""
    positions = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return frozenset(positions[w] for node in gm.graph.nodes if node.op == "call_function"
                     for w in written_args(node) if w in positions)


def static_buffer(t: torch.Tensor, index: int, name: Optional[str] = None) -> torch.Tensor:
    """A copy of t with t's exact layout (expanded, strided, offset or empty), owned by a graph."""
    reason = uncopyable_reason(t)
    if reason is not None:
        raise CaptureError(f"{name or f'input {index}'} cannot be copied into a static buffer: {reason}")
    with torch.no_grad():
        return static_copy(t)

"""The local runtime: each captured partition runs as forward/backward (or inference) graphs of its own.

Per partition, aot_autograd (run lazily at the first call of each input signature, with the real tensors)
splits the submodule into functional aten forward and backward graphs; aot's runtime wrappers keep doing input
mutation copy-back and output aliasing, while our compilers wrap each graph in a `_Family` that warms up,
captures and replays it through the driver. The buffer rules, in one place:

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
  held takes another instance or runs eagerly).
- Inputs the graph itself writes (Inductor keeps some input mutations in its graphs) are restored after
  capture, which runs the graph once, and copied back to the caller's tensor after each replay.

See ModelRuntime for the memory-pool rules and `compile_partition` for the entry point.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from .. import _compat
from ..counters import add as _count, record as _record
from . import release as _release
from .driver import CaptureError, CapturedGraph, Driver, EagerDriver, get_driver

__all__ = ["ModelRuntime", "compile_partition", "is_static_tensor"]

log = logging.getLogger("cgcompile")

# How a call argument reaches a graph's static input.
_CONST, _PARAM, _BORROWED, _OWNED = "const", "param", "borrowed", "owned"
_MISMATCH = object()  # match(): this graph was captured for other addresses/values; try another instance

_PROGRESS_AFTER_S = 2.0
_EAGER = EagerDriver()


def is_static_tensor(arg: Any) -> bool:
    """A parameter or buffer seen at run time: nn.Parameter, or a tensor Dynamo marked static (it marks module
    buffers too). Their addresses stay fixed between calls, so graphs read them in place."""
    return isinstance(arg, torch.nn.Parameter) or (
        isinstance(arg, torch.Tensor) and hasattr(arg, "_dynamo_static_input_type"))


def _storage_ptr(t: torch.Tensor) -> int:
    return _compat.storage_key(t)[0]


# --- model runtime -------------------------------------------------------------------------------------------


class ModelRuntime:
    """One per compiled frame: owns the driver, the shared graph pool and the registry of static memory.

    Pools: every graph captured before any graph is used a second time (the first capture wave: a steady
    training step's graphs, captured in the order they run) shares one pool, so a graph's temporaries can
    reuse memory another graph freed; graphs captured later (new shapes, extra instances, re-captures, eval
    graphs) get a private pool. Sharing is safe only if a graph never replays while memory it may scribble
    over is still needed: its temporaries may overlap the static memory of graphs captured *after* it in the
    same pool. So, besides its own busy check, a shared-pool graph replays only when no later-captured
    shared-pool graph is busy; otherwise the call takes another instance (a steady loop replays in capture
    order, so this only adds instances where a later graph's outputs outlive the next call, as in fwd, fwd,
    bwd, bwd). The emulate driver has no pools; the rule runs there all the same.

    Capture summary: one INFO line ("captured N graphs in X s, Y GiB") when the first wave ends, i.e. at
    the first second use of a graph; `log_capture_summary()` logs it earlier if called (once either way).
    When the wave's captures take longer than 2 s a progress display appears (tqdm if installed).
    """

    def __init__(self, config: Any, device: Any):
        self.config = config
        self.device = torch.device(device)
        self.driver: Driver = get_driver(str(config.driver), self.device)
        self._owners: Dict[int, _Graph] = {}  # storage data_ptr -> graph owning that memory
        self._shared: List[Optional[_Graph]] = []  # shared-pool graphs in capture order (None: discarded)
        self._shared_pool: Any = None
        self._wave_open = True
        self._wave = {"graphs": 0, "seconds": 0.0, "bytes": 0}
        self._summary_logged = False
        self._progress: Optional[_Progress] = None
        self._partitions: "weakref.WeakSet[_Partition]" = weakref.WeakSet()
        _release.register(self)

    # public ---------------------------------------------------------------------------------------------

    def is_static(self, t: Any) -> bool:
        """Does `t` alias memory owned by one of our graphs (a static output or a static input buffer)?"""
        return isinstance(t, torch.Tensor) and bool(self._owners) and _storage_ptr(t) in self._owners

    def finish_frame_outputs(self, outputs: Any) -> Any:
        """Clone the frame outputs that alias static memory (when config.clone_outputs), so the next replay
        cannot overwrite what the caller holds. Handles a tensor or a flat list/tuple (Dynamo's output)."""
        if not self.config.clone_outputs or not self._owners:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs.clone() if self.is_static(outputs) else outputs
        if isinstance(outputs, (list, tuple)):
            fixed = [o.clone() if self.is_static(o) else o for o in outputs]
            if type(outputs) in (list, tuple):
                return type(outputs)(fixed)
            return type(outputs)(*fixed)  # namedtuple
        return outputs

    def log_capture_summary(self) -> None:
        """Log the capture summary line now (once per runtime; no-op before the first capture)."""
        if self._summary_logged or not self._wave["graphs"]:
            return
        self._summary_logged = True
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        wave = self._wave
        memory = f", {wave['bytes'] / 2**30:.2f} GiB" if self.driver.name == "cuda" else ""
        log.info("cgcompile: captured %d graphs in %.1f s%s (driver %s)", wave["graphs"], wave["seconds"],
                 memory, self.driver.name)

    def release(self) -> None:
        """Drop every graph, the shared pool and the driver's stream (cgcompile.release()); the partitions
        warm up and capture again on their next calls. A pending backward of a released forward runs eagerly."""
        for part in list(self._partitions):
            part.release()
        self._owners.clear()
        self._shared, self._shared_pool, self._wave_open = [], None, True
        self.driver.release()

    def graph_memory(self) -> List[Dict[str, Any]]:
        """Per live graph: its partition, kind, the pool bytes its capture reserved (CUDA only), and the bytes
        of the static input buffers and outputs it owns (what it keeps allocated between calls)."""
        rows = []
        for part in list(self._partitions):
            for variant in part.bank.values():
                for family in (variant.forward, variant.inference):
                    for graph in family.graphs if family is not None else ():
                        for g, kind in ((graph, family.kind), (graph.bw, "backward")):
                            if g is not None and g.captured is not None:
                                rows.append({"partition": part.name, "kind": kind, **g.memory()})
        return rows

    # internal -------------------------------------------------------------------------------------------

    def driver_for(self, example_inputs: Sequence[Any]) -> Driver:
        """The runtime's driver, or eager for a partition without a CUDA tensor under the cuda driver."""
        if self.driver.name == "cuda" and not any(
                isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs):
            return _EAGER
        return self.driver

    def owner(self, t: torch.Tensor) -> Optional["_Graph"]:
        return self._owners.get(_storage_ptr(t)) if self._owners else None

    def pool(self) -> Tuple[Any, bool]:
        """(pool token, shared?) for the next capture."""
        if self._wave_open:
            if self._shared_pool is None:
                self._shared_pool = self.driver.new_pool()
            return self._shared_pool, True
        return self.driver.new_pool(), False

    def lenders(self, args: Sequence[Any]) -> Dict[int, Tuple["_Graph", int, int]]:
        """For the arguments living in our graphs' memory: storage ptr -> (owner, handle, use count now)."""
        found: Dict[int, Tuple[_Graph, int, int]] = {}
        for arg in args:
            if isinstance(arg, torch.Tensor) and self._owners:
                ptr, sid = _compat.storage_key(arg)
                if ptr in self._owners and ptr not in found:
                    found[ptr] = (self._owners[ptr], sid, _compat.storage_use_count(sid))
        return found

    def register(self, graph: "_Graph", shared: bool, lenders: Dict[int, Tuple["_Graph", int, int]]) -> None:
        """Record a new graph's memory: what it owns (with use-count baselines) and what it borrows.

        `lenders` was measured before the capture with the same caller references alive, so the growth
        of each lender's use count is exactly the references the new graph keeps (its held inputs, outputs
        that view them, and anything those keep alive) and goes into the lender's idle baseline.
        """
        for ptr, sid in graph.owned_storages():
            graph.owned[ptr] = [sid, 0]
            self._owners[ptr] = graph
        for ptr, (lender, sid, before) in lenders.items():
            if lender.captured is not None and ptr in lender.owned:
                kept = _compat.storage_use_count(sid) - before
                lender.owned[ptr][1] += kept
                graph.borrowed_from.append((lender, ptr, kept))
        for entry in graph.owned.values():  # nothing handed out yet: current count = our own references
            entry[1] += _compat.storage_use_count(entry[0])
        if shared:
            graph.shared_index = len(self._shared)
            self._shared.append(graph)
        captured = graph.captured
        seconds = graph.capture_seconds
        _count("graphs_captured")
        _count("capture_seconds", seconds)
        _count("pool_bytes", captured.pool_bytes)
        if not self._summary_logged:
            self._wave["graphs"] += 1
            self._wave["seconds"] += seconds
            self._wave["bytes"] += captured.pool_bytes
            if self._wave["seconds"] > _PROGRESS_AFTER_S:
                if self._progress is None:
                    self._progress = _Progress(self._wave["graphs"])
                else:
                    self._progress.update()

    def discard(self, graph: Optional["_Graph"]) -> None:
        """Forget a graph (re-capture, fallback): release its memory claims so its storage can be freed."""
        if graph is None:
            return
        for ptr in graph.owned:
            if self._owners.get(ptr) is graph:
                del self._owners[ptr]
        for lender, ptr, kept in graph.borrowed_from:
            if ptr in lender.owned:
                lender.owned[ptr][1] -= kept
        graph.borrowed_from = []
        graph.owned = {}
        if graph.shared_index is not None:
            self._shared[graph.shared_index] = None
        if graph.bw is not None:
            self.discard(graph.bw)
            graph.bw = None
        graph.captured = None

    def may_replay(self, graph: "_Graph") -> bool:
        """Pool rule (see class docstring): no later-captured shared-pool graph may be busy."""
        if graph.shared_index is None:
            return True
        free = True
        for later in self._shared[graph.shared_index + 1:]:
            if later is not None and (later.blocked_by_grads() or later.busy()):
                free = False  # no early exit: every graph holding stolen grads stops handing them out
        return free

    def note_replay(self, graph: "_Graph") -> None:
        graph.replays += 1
        if graph.replays > 1 and self._wave_open:  # replay 1 follows the capture itself
            self._wave_open = False
            self.log_capture_summary()


class _Progress:
    """Shows progress of a long capture wave: tqdm when installed, else a throttled stderr line."""

    def __init__(self, done: int):
        self.done = done
        self._last = 0.0
        try:
            from tqdm import tqdm
            self._bar = tqdm(desc="cgcompile: capturing CUDA graphs", unit="graph", initial=done)
        except ImportError:
            self._bar = None
        self._show()

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        else:
            self._show()

    def _show(self) -> None:
        now = time.monotonic()
        if self._bar is None and now - self._last >= 1.0:
            self._last = now
            sys.stderr.write(f"\rcgcompile: capturing CUDA graphs... {self.done} captured")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")


# --- one captured graph --------------------------------------------------------------------------------------


class _Graph:
    """One captured graph, and how each argument of a call reaches its static inputs."""

    def __init__(self, family: "_Family", captured: CapturedGraph, kinds: List[str], param_storages: frozenset,
                 capture_seconds: float):
        self.family = family
        self.captured: Optional[CapturedGraph] = captured
        self.kinds = kinds
        self.param_storages = param_storages
        self.capture_seconds = capture_seconds
        inputs = captured.static_inputs
        self.param_ptrs = {i: inputs[i].data_ptr() for i, k in enumerate(kinds) if k is _PARAM}
        self.param_refs: Dict[int, weakref.ref] = {}  # the caller's parameter objects, to tell "moved" apart
        # match() runs on every call: the expected address or value per position, computed once here.
        self.param_checks = list(self.param_ptrs.items())
        self.borrow_checks = [(i, inputs[i].data_ptr()) for i, k in enumerate(kinds) if k is _BORROWED]
        self.const_checks = [(i, inputs[i]) for i, k in enumerate(kinds) if k is _CONST]
        self.copies = [i for i, k in enumerate(kinds) if k is _OWNED]
        self.copy_back: List[int] = []  # copied-in inputs the graph writes: the caller's tensor gets the result
        self.owned: Dict[int, List[int]] = {}  # storage ptr -> [storage handle, use count when idle]
        self.borrowed_from: List[Tuple[_Graph, int, int]] = []  # (lender, storage ptr, references we keep)
        self.shared_index: Optional[int] = None
        self.replays = 0
        self.handed: List[weakref.ref] = []  # the aliases the last replay handed out
        self.free = False  # seen idle since its last replay: stays so until the next replay (see busy())
        self.bw: Optional[_Graph] = None  # a forward instance's backward graph
        self.cleared_streak = 0  # backward: replays in a row that found the parameters' grads cleared
        self.steal = False  # backward: hand out aliases that AccumulateGrad may keep as param.grad

    def memory(self) -> Dict[str, int]:
        """Bytes this graph holds: its pool reservation, its copied-in input buffers, its own outputs."""
        inputs = self.captured.static_inputs
        nbytes = {_compat.storage_key(t)[0]: t.untyped_storage().nbytes() for t in inputs
                  if isinstance(t, torch.Tensor)}
        buffers = sum(nbytes[_storage_ptr(t)] for t, k in zip(inputs, self.kinds) if k is _OWNED)
        outputs = {_storage_ptr(t): t.untyped_storage().nbytes() for t in self.captured.static_outputs
                   if isinstance(t, torch.Tensor) and _storage_ptr(t) not in nbytes}
        return {"pool_bytes": self.captured.pool_bytes, "static_input_bytes": buffers,
                "static_output_bytes": sum(outputs.values())}

    def owned_storages(self) -> List[Tuple[int, int]]:
        """Storages this graph owns: its copied-in input buffers and outputs not aliasing other inputs."""
        inputs = self.captured.static_inputs
        foreign = {_storage_ptr(t) for t, k in zip(inputs, self.kinds) if k in (_PARAM, _BORROWED)}
        found: Dict[int, int] = {}
        candidates = [t for t, k in zip(inputs, self.kinds) if k is _OWNED] + list(self.captured.static_outputs)
        for t in candidates:
            if isinstance(t, torch.Tensor):
                ptr, sid = _compat.storage_key(t)
                if ptr and ptr not in foreign:
                    found.setdefault(ptr, sid)
        return list(found.items())

    def busy(self) -> bool:
        """Is an alias from the last replay alive (e.g. saved for a pending backward), or does anything
        besides the runtime still reference this graph's memory (a view, a `.detach()`ed copy)?

        Once idle, a graph stays idle until its next replay: new references to its memory come only from
        a replay's aliases, or from a borrower replaying on it, which needs a live reference already.
        So the result is cached, which keeps the pool rule's scans cheap.
        """
        if self.free:
            return False
        for ref in self.handed:
            if ref() is not None:
                return True
        for sid, idle in self.owned.values():
            if _compat.storage_use_count(sid) > idle:
                return True
        self.free = True
        return False

    def match(self, args: Sequence[Any]) -> Any:
        """None if this graph can run `args`; else _MISMATCH (captured for other addresses, e.g. another
        layer's parameters when Dynamo reuses one compiled frame for every layer), or a reason string when
        one of *its own* static inputs has moved since capture (the graph is stale: re-capture it)."""
        for i, ptr in self.param_checks:
            if args[i].data_ptr() != ptr:
                return self.moved(i) or _MISMATCH
        for i, ptr in self.borrow_checks:
            if args[i].data_ptr() != ptr:
                return _MISMATCH
        for i, value in self.const_checks:
            arg = args[i]
            if isinstance(arg, torch.Tensor) or arg != value:
                return _MISMATCH
        return None

    def moved(self, i: int) -> Optional[str]:
        """Why this graph is stale, if the parameter it was captured with at position i now lives elsewhere
        (else the call simply passes another parameter, e.g. another layer's)."""
        ref = self.param_refs.get(i)
        param = ref() if ref is not None else None
        if param is not None and param.data_ptr() != self.param_ptrs[i]:
            return f"static input {i} moved (parameter or buffer re-allocated)"
        return None

    def blocked_by_grads(self) -> bool:
        """Is this (backward) graph busy because grads it let AccumulateGrad steal are still held? Then it
        stops handing out stealable aliases: this loop keeps its grads."""
        if self.steal and self.busy():
            self.steal, self.cleared_streak = False, 0
            log.debug("cgcompile: %s: gradients kept across steps; backward outputs are copied from now on",
                      self.family.part.describe())
            return True
        return False

    def replay(self, args: Sequence[Any], runtime: ModelRuntime, alias: bool) -> List[Any]:
        inputs = self.captured.static_inputs
        with torch.no_grad():
            for i in self.copies:
                arg, buf = args[i], inputs[i]
                if arg.data_ptr() != buf.data_ptr():
                    buf.copy_(arg)
            self.free = False
            outputs = list(self.captured.replay())
            for i in self.copy_back:
                if args[i].data_ptr() != inputs[i].data_ptr():
                    args[i].copy_(inputs[i])
            self.handed = []
            if alias:
                outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]
                for out in outputs:
                    if isinstance(out, torch.Tensor):
                        if self.family.kind != "backward":
                            out._cgcompile_graph = self  # lets the backward find its forward instance
                        self.handed.append(weakref.ref(out))
        _count("replays")
        runtime.note_replay(self)
        return outputs


# --- the graphs of one aot graph -----------------------------------------------------------------------------


def _mutated_inputs(gm: fx.GraphModule) -> frozenset:
    """Positions of gm's inputs that an op in gm writes (per the op schemas' alias annotations)."""
    positions = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    mutated = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, fx.Node) and value in positions:
                mutated.add(positions[value])
    return frozenset(mutated)


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Could two elements of t share memory (e.g. after expand)? Conservative: False means surely not."""
    span = 0
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _static_buffer(t: torch.Tensor, index: int) -> torch.Tensor:
    """A copy of t with t's exact layout, owned by a graph."""
    if _overlaps_itself(t):
        raise CaptureError(f"input {index} has self-overlapping memory (e.g. from expand) and cannot be "
                           f"copied into a static buffer")
    with torch.no_grad():
        buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        buf.copy_(t)
    return buf


class _Family:
    """The captured instances of one aot graph (forward, backward or inference) of one bank entry."""

    def __init__(self, variant: "_Variant", kind: str, run: Callable[[list], Any], mutated: frozenset):
        self.variant = variant
        self.part = variant.part
        self.kind = kind
        self.run = run  # the uncaptured graph (aot graph, or Inductor's compiled version)
        self.mutated = mutated  # inputs the graph itself writes (Inductor keeps some input mutations)
        self.calls = 0
        self.graphs: List[_Graph] = []  # forward/inference instances

    def __call__(self, args: list) -> Any:
        part = self.part
        if part.broken is not None or not part.driver.captures:
            return self.run(args)
        if self.kind == "backward":
            return self._backward(args)
        self.calls += 1
        if self.calls <= part.config.cuda_graph_warmup_steps:
            return self.run(args)
        return self._forward(args)

    def _forward(self, args: list) -> Any:
        part, runtime = self.part, self.part.runtime
        stale = None
        for index, graph in enumerate(self.graphs):
            verdict = graph.match(args)  # first: cheapest, and fails fast for other layers' instances
            if verdict is _MISMATCH or graph.busy() or not runtime.may_replay(graph):
                continue
            if graph.bw is not None and (graph.bw.blocked_by_grads() or graph.bw.busy()):
                continue
            if verdict is None:
                return graph.replay(args, runtime, alias=True)
            if stale is None:
                stale = (index, verdict)
        if stale is not None:
            return self._capture_and_run(args, replace=stale[0], reason=stale[1])
        params = frozenset(part.static_storages())
        cap = part.config.max_graphs_per_partition
        if part.graph_counts.get(params, 0) >= cap:
            part.eager_call(f"max_graphs_per_partition={cap} reached (every instance busy or captured for "
                            f"other inputs); this call runs eagerly")
            return self.run(args)
        return self._capture_and_run(args)

    def _capture_and_run(self, args: list, replace: Optional[int] = None, reason: str = "") -> Any:
        part, runtime = self.part, self.part.runtime
        if replace is not None:
            old = self.graphs[replace]
            part.graph_counts[old.param_storages] -= 1
            runtime.discard(old)
            _record("recaptures", part.name, reason)
            log.info("cgcompile: re-capturing %s %s graph: %s", part.describe(), self.kind, reason)
        try:
            graph = self._capture(args, frozenset(part.static_storages()))
        except Exception as exc:
            part.fail(f"capturing its {self.kind} graph failed: {type(exc).__name__}: {exc}")
            return self.run(args)
        graph.param_refs = {i: weakref.ref(args[i]) for i, k in enumerate(graph.kinds) if k is _PARAM}
        part.graph_counts[graph.param_storages] = part.graph_counts.get(graph.param_storages, 0) + 1
        if replace is None:
            self.graphs.append(graph)
        else:
            self.graphs[replace] = graph
        return graph.replay(args, runtime, alias=True)

    def _backward(self, args: list) -> Any:
        forward = self.variant.forward
        instance = forward.instance_for(args) if forward is not None else None
        if instance is None or instance.captured is None:
            return self.run(args)  # its forward ran eagerly (warmup, cap, fallback)
        runtime = self.part.runtime
        if instance.bw is None:
            try:
                instance.bw = self._capture(args, instance.param_storages)
            except Exception as exc:
                self.part.fail(f"capturing its backward graph failed: {type(exc).__name__}: {exc}")
                return self.run(args)
        elif (instance.bw.busy() or not runtime.may_replay(instance.bw)
              or instance.bw.match(args) is not None):
            return self.run(args)  # e.g. a second backward through the same forward (retain_graph)
        bw = instance.bw
        if self._grads_cleared(instance):
            bw.cleared_streak += 1
            bw.steal = bw.steal or bw.cleared_streak >= 2
        else:
            bw.cleared_streak, bw.steal = 0, False
        return bw.replay(args, runtime, alias=bw.steal)

    @staticmethod
    def _grads_cleared(instance: _Graph) -> bool:
        """Are the grads of the parameters this instance reads unset, as after zero_grad(set_to_none=True)?
        Checked before the backward replays, i.e. before AccumulateGrad runs for them."""
        params = [ref() for ref in instance.param_refs.values()]
        return all(p is None or p.grad is None for p in params)

    def instance_for(self, backward_args: Sequence[Any]) -> Optional[_Graph]:
        """The forward instance that produced these saved tensors, if any.

        Saved tensors reach the backward as the very alias objects a replay handed out (autograd keeps
        them), which carry their graph; failing that, memory only one instance owns identifies it. A busy
        instance is never replayed, so an instance has at most one pending backward.
        """
        runtime = self.part.runtime
        tensors = [a for a in backward_args if isinstance(a, torch.Tensor)]
        for arg in tensors:
            graph = getattr(arg, "_cgcompile_graph", None)
            if graph is not None and graph.family is self:
                return graph
        for arg in tensors:
            graph = runtime.owner(arg)
            if graph is not None and graph.family is self:
                return graph
        return None

    def _capture(self, args: list, param_storages: frozenset) -> _Graph:
        runtime = self.part.runtime
        lenders = runtime.lenders(args)
        kinds: List[str] = []
        inputs: List[Any] = []
        for index, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor):
                kinds.append(_CONST)
                inputs.append(arg)
                continue
            # Static and borrowed inputs are held as detached aliases: the graph needs their memory, not
            # their autograd history (holding a caller's tensor would keep its whole autograd graph alive).
            ptr = _storage_ptr(arg)
            if ptr and ptr in param_storages:
                kinds.append(_PARAM)
                inputs.append(arg.detach())
            elif ptr and runtime.owner(arg) is not None:
                kinds.append(_BORROWED)
                inputs.append(arg.detach())
            else:
                kinds.append(_OWNED)
                inputs.append(_static_buffer(arg, index))
        # Capturing runs the graph once (emulate; CUDA's warmup): undo its writes to inputs, or the replay
        # that produces this call's results would apply them a second time.
        with torch.no_grad():
            saved = {i: inputs[i].clone() for i in self.mutated if isinstance(inputs[i], torch.Tensor)}
        pool, shared = runtime.pool()
        start = time.perf_counter()
        captured = self.part.driver.capture(self.run, inputs, pool)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            for i, value in saved.items():
                inputs[i].copy_(value)
        graph = _Graph(self, captured, kinds, param_storages, seconds)
        graph.copy_back = [i for i in self.mutated if kinds[i] is _OWNED]
        del inputs, captured, saved
        runtime.register(graph, shared, lenders)
        return graph

    def discard(self) -> None:
        for graph in self.graphs:
            self.part.runtime.discard(graph)
        self.graphs = []


# --- one input signature of a partition ----------------------------------------------------------------------


class _Variant:
    """One aot_autograd compilation of a partition (one graph-bank key) and its forward/backward/inference
    graph families (which aot creates through our compilers)."""

    def __init__(self, part: "_Partition", args: Sequence[Any]):
        self.part = part
        self.forward: Optional[_Family] = None
        self.backward: Optional[_Family] = None
        self.inference: Optional[_Family] = None
        self.fn = _compat.aot_compile(part.traced, args, self._runner,
                                      inductor=str(part.config.inner_compiler) == "inductor")

    def _runner(self, kind: str, run: Callable[[list], Any], gm: fx.GraphModule) -> Callable[[list], Any]:
        """Called by aot for each graph it compiles: what aot runs instead of it."""
        family = _Family(self, kind, run, _mutated_inputs(gm))
        setattr(self, kind, family)

        def run_family(args: list) -> Any:
            return family(args)

        return run_family

    def discard(self) -> None:
        for family in (self.forward, self.inference):
            if family is not None:
                family.discard()


# --- one partition -------------------------------------------------------------------------------------------


def _tuple_returning(gm: fx.GraphModule) -> Tuple[Optional[type], fx.GraphModule]:
    """(container type of gm's result, or None for a single value; a tuple-returning copy for aot)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    result = output.args[0]
    if type(result) is tuple:
        return tuple, gm
    graph = fx.Graph()
    copied = graph.graph_copy(gm.graph, {})
    if isinstance(result, (list, tuple)):
        graph.output(tuple(copied))
        return type(result), fx.GraphModule(gm, graph)
    graph.output((copied,))
    return None, fx.GraphModule(gm, graph)


class _Partition:
    """The callable compile_partition returns: graph bank, warmup/capture, permanent eager fallback."""

    def __init__(self, submod: fx.GraphModule, name: str, static_input_indices: Sequence[int],
                 runtime: ModelRuntime, location: Optional[str], driver: Driver):
        self.submod = submod
        self.name = name
        self.location = location
        self.static_indices = frozenset(static_input_indices)
        self.runtime = runtime
        self.config = runtime.config
        self.driver = driver
        self.container, self.traced = _tuple_returning(submod)
        self.bank: Dict[Any, _Variant] = {}
        # Forward/inference instances captured, over all bank keys, per parameter set: Dynamo reuses one
        # compiled frame for every layer of a model that graph-breaks inside its layers, so one partition
        # may serve many parameter sets, each needing graphs of its own (as Megatron has per layer).
        self.graph_counts: Dict[frozenset, int] = {}
        self.broken: Optional[str] = None
        self._warned: set = set()
        self._args: Optional[Sequence[Any]] = None
        runtime._partitions.add(self)

    def __call__(self, *args: Any) -> Any:
        if self.broken is not None:
            return self.submod(*args)
        key = self._key(args)
        variant = self.bank.get(key)
        if variant is None:
            try:
                variant = self.bank[key] = _Variant(self, args)
            except Exception as exc:
                self.fail(f"compiling it failed: {type(exc).__name__}: {exc}")
                return self.submod(*args)
        self._args = args
        try:
            out = variant.fn(*args)
        finally:
            self._args = None
        if self.container is None:
            return out[0]
        return self.container(out)

    def _key(self, args: Sequence[Any]) -> tuple:
        """Graph-bank key: grad/inference/autocast mode, and per argument its metadata or value.

        Parameters and buffers (the static indices) are left out: Dynamo's guards on the frame already fix
        their shape, stride, dtype, device and requires_grad, and a decode step's partition takes a hundred of
        them, so keying them would cost more host time per call than the rest of the replay path."""
        key: List[Any] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                          torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"), len(args)]
        static = self.static_indices
        for index, arg in enumerate(args):
            if index in static:
                continue
            if isinstance(arg, torch.Tensor):
                key.append((arg.shape, arg.stride(), arg.dtype, arg.device, arg.requires_grad))
            else:
                try:
                    hash(arg)
                    key.append((type(arg), arg))
                except TypeError:
                    key.append((type(arg), id(arg)))
        return tuple(key)

    def static_storages(self) -> set:
        """Storages of this call's parameters and buffers: the indices given, Parameters, Dynamo-marked
        static tensors, and the submodule's own parameters/buffers (aot passes those first)."""
        found = set()
        args = self._args or ()
        for index, arg in enumerate(args):
            if is_static_tensor(arg) or (isinstance(arg, torch.Tensor) and index in self.static_indices):
                found.add(_storage_ptr(arg))
        for tensor in list(self.submod.parameters()) + list(self.submod.buffers()):
            found.add(_storage_ptr(tensor))
        found.discard(0)
        return found

    def describe(self) -> str:
        return f"partition {self.name}" + (f" ({self.location})" if self.location else "")

    def fail(self, reason: str) -> None:
        """Fall back to eager for good: log once, count, release graphs. The current call still completes."""
        if self.broken is not None:
            return
        self.broken = reason
        log.warning("cgcompile: %s runs eagerly from now on: %s", self.describe(), reason)
        _record("eager_fallbacks", self.name, reason, once=True)
        for variant in self.bank.values():
            variant.discard()
        self.bank = {}

    def release(self) -> None:
        """Forget every graph (cgcompile.release()): the next call compiles, warms up and captures anew."""
        for variant in self.bank.values():
            variant.discard()
        self.bank, self.graph_counts = {}, {}

    def eager_call(self, reason: str) -> None:
        """One call runs eagerly (bank full): log and count once per partition and reason."""
        _record("eager_fallbacks", self.name, reason, once=True)
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("cgcompile: %s: %s", self.describe(), reason)


def compile_partition(submod: fx.GraphModule, example_inputs: Sequence[Any], *, name: str,
                      static_input_indices: Sequence[int], runtime: ModelRuntime,
                      location: Optional[str] = None) -> Callable[..., Any]:
    """Wrap one captured partition of a split Dynamo graph.

    Returns a callable with submod's calling convention (positional args; returns what submod returns).
    It compiles and captures lazily, at run time, with real tensors. `static_input_indices` are the
    positions of parameters/buffers (nn.Parameter arguments and tensors Dynamo marked with
    `_dynamo_static_input_type` count as static too). `location` ("file:line") goes into fallback warnings.
    When nothing would be captured or compiled (eager driver and eager inner compiler), submod itself is
    returned: the cheapest host path.
    """
    driver = runtime.driver_for(example_inputs)
    if not driver.captures and str(runtime.config.inner_compiler) == "eager":
        return submod
    return _Partition(submod, name, static_input_indices, runtime, location, driver)

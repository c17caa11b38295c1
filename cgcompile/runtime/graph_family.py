"""The graphs of one partition's input signature: a `BankEntry` (one aot_autograd compilation per graph-bank key)
and its `GraphFamily`s (the captured instances of one aot graph, forward, backward or inference: which instance
a call replays, when a new one is captured, the eager warmup before).

aot_autograd splits the partition into functional aten forward and backward graphs; its runtime wrappers keep
doing input mutation copy-back and output aliasing, while our compilers wrap each graph in a GraphFamily that
warms up, captures and replays it through the driver. The partition they belong to (`part`, a PartitionRunner,
partition_runner.py) keeps the bank, its policy and the eager fallback; the buffer rules are in graph.py.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.fx as fx

from .. import _compat
from ..counters import record
from . import bank_policy
from .arena import OutputLayout, output_layouts
from .global_state import preserved_global_state
from .graph import MISMATCH, GraphInstance, capture_instance, mutated_inputs
from .traced_strides import keep_traced_strides

__all__ = ["BankEntry", "GraphFamily"]

log = logging.getLogger("cgcompile")


# --- the graphs of one aot graph -----------------------------------------------------------------------------


class GraphFamily:
    """The captured instances of one aot graph (forward, backward or inference) of one bank entry."""

    def __init__(self, entry: "BankEntry", kind: str, run: Callable[[list], Any], mutated: frozenset):
        self.entry = entry
        self.part = entry.part
        self.kind = kind
        self.run = run  # the uncaptured graph (aot graph, or Inductor's compiled version)
        self.mutated = mutated  # inputs the graph itself writes (Inductor keeps some input mutations)
        self.calls = 0
        self.graphs: List[GraphInstance] = []  # forward/inference instances
        self.layouts: Optional[List[OutputLayout]] = None  # its outputs' layouts, seen in an eager run (arenas)

    def run_eagerly(self, args: list) -> Any:
        """The uncaptured graph; for a partition whose sizes vary, its outputs' layouts are noted on the way
        (an output arena is sized before capture, arena.py)."""
        out = self.run(args)
        if self.part.sized and self.layouts is None:
            self.layouts = output_layouts(list(out), args, self.part.runtime.device)
        return out

    def __call__(self, args: list) -> Any:
        part = self.part
        if part.broken is not None or not part.driver.captures:
            return self.run(args)
        if self.kind == "backward":
            return self._backward(args)
        self.calls += 1
        counters = part.counters
        part.tick += 1
        counters.calls += 1
        if self.calls <= part.config.cuda_graph_warmup_steps:
            counters.misses += 1
            return self.run_eagerly(args)
        out = self._forward(args)
        part.judge()
        if part.tick >= part.next_sweep:
            part.sweep()
        return out

    def _forward(self, args: list) -> Any:
        part, runtime = self.part, self.part.runtime
        stale = None
        for index, graph in enumerate(self.graphs):
            verdict = graph.match(args)  # first: cheapest, and fails fast for other layers' instances
            if verdict is MISMATCH or graph.busy() or not runtime.may_replay(graph):
                continue
            if graph.bw is not None and graph.bw.busy():  # its grads, stolen as .grad, are still held
                continue
            if verdict is None:
                part.counters.replays += 1
                graph.mark_used(part.tick)
                return graph.replay(args, runtime, alias=True)
            if stale is None:
                stale = (index, verdict)
        part.counters.misses += 1
        if stale is not None:
            return self._capture_and_run(args, replace=stale[0], reason=stale[1])
        if part.counters.stopped is not None:
            return self.run(args)  # stopped capturing new sizes (bank policy); its graphs still replay
        part.sweep()  # room for the new graph first
        params = frozenset(part.static_storages())
        cap = part.config.max_graphs_per_partition
        if part.graph_counts.get(params, 0) >= cap:
            part.eager_call(f"max_graphs_per_partition={cap} reached (every instance busy or captured for "
                            f"other inputs); this call runs eagerly")
            return self.run(args)
        return self._capture_and_run(args)

    def _capture_and_run(self, args: list, replace: Optional[int] = None, reason: str = "") -> Any:
        part, runtime = self.part, self.part.runtime
        streak = 0
        if replace is not None:
            old = self.graphs.pop(replace)
            part.graph_counts[old.param_storages] -= 1
            streak = bank_policy.recapture_streak(old.recapture_streak, old.replays)
            runtime.discard(old)
            part.counters.recaptures += 1
            record("recaptures", part.name, reason)
            if bank_policy.storm(streak):
                part.fail(f"re-capture storm: its {self.kind} graph was re-captured {streak} times in a row without "
                          f"a replay in between ({reason}); capturing it costs more than running it eagerly",
                          storm=True)
                return self.run(args)
            log.info("cgcompile: re-capturing %s %s graph: %s", part.describe(), self.kind, reason)
        try:
            graph = self._capture(args, frozenset(part.static_storages()))
        except Exception as exc:
            part.fail(f"capturing its {self.kind} graph failed: {type(exc).__name__}: {exc}")
            return self.run(args)
        graph.remember_params(args)
        graph.enter_bank(graph.name, part.tick, streak)
        part.counters.captures += 1
        part.unjudged.append((part.tick, weakref.ref(graph)))
        part.graph_counts[graph.param_storages] = part.graph_counts.get(graph.param_storages, 0) + 1
        self.graphs.append(graph)
        return graph.replay(args, runtime, alias=True)

    def _backward(self, args: list) -> Any:
        forward = self.entry.forward
        instance = forward.instance_for(args) if forward is not None else None
        if instance is None or instance.captured is None:
            return self.run_eagerly(args)  # its forward ran eagerly (warmup, cap, fallback)
        runtime = self.part.runtime
        if instance.bw is None:
            try:
                instance.attach_backward(self._capture(args, instance.param_storages))
            except Exception as exc:
                self.part.fail(f"capturing its backward graph failed: {type(exc).__name__}: {exc}")
                return self.run(args)
        elif (instance.bw.busy() or not runtime.may_replay(instance.bw)
              or instance.bw.match(args) is not None):
            return self.run(args)  # e.g. a second backward through the same forward (retain_graph)
        bw = instance.bw
        bw.note_grads(self._grads_cleared(instance))
        # An arena's memory is shared with other sizes: hand out aliases, whose lives the arena can see (autograd
        # may hold a returned grad in an input buffer until another size's backward has run).
        return bw.replay(args, runtime, alias=bw.steal or bw.arena is not None)

    @staticmethod
    def _grads_cleared(instance: GraphInstance) -> bool:
        """Are the grads of the parameters this instance reads unset, as after zero_grad(set_to_none=True)?
        Checked before the backward replays, i.e. before AccumulateGrad runs for them."""
        params = [ref() for ref in instance.param_refs.values()]
        return all(p is None or p.grad is None for p in params)

    def instance_for(self, backward_args: Sequence[Any]) -> Optional[GraphInstance]:
        """The forward instance that produced these saved tensors, if any.

        Saved tensors reach the backward as the very alias objects a replay handed out (autograd keeps
        them), which carry their graph; failing that, memory only one instance owns identifies it. A busy
        instance is never replayed, so an instance has at most one pending backward.
        """
        runtime = self.part.runtime
        tensors = [a for a in backward_args if isinstance(a, torch.Tensor)]
        for arg in tensors:
            graph = getattr(arg, "_cgcompile_graph", None)
            if graph is not None and graph.owner is self:
                return graph
        for arg in tensors:
            graph = runtime.owner(arg)
            if graph is not None and graph.owner is self:
                return graph
        return None

    def _capture(self, args: list, param_storages: frozenset) -> GraphInstance:
        part = self.part
        forward = self.entry.forward.instance_for(args) if self.kind == "backward" else None
        name = forward.name if forward is not None else part.graph_name(args, param_storages)
        arenas = part.arena_group(self.kind, param_storages) if part.sized else None
        graph = capture_instance(self, part.name, f"{name} {self.kind}", self.kind, self.run, args, param_storages,
                                 self.mutated, part.runtime, part.driver, part.input_names_of(args),
                                 arenas, self.layouts)
        graph.enter_bank(name, part.tick)
        if arenas is not None:
            part.retire_superseded(arenas)
        return graph

    def discard(self) -> None:
        for graph in self.graphs:
            self.part.runtime.discard(graph)
        self.graphs = []

    def drop_backward(self, bw: GraphInstance) -> None:
        """Forget the backward graph `bw` of whichever of these forward instances owns it (captured again later)."""
        for graph in self.graphs:
            if graph.bw is bw:
                graph.attach_backward(None)


# --- one input signature of a partition ----------------------------------------------------------------------


class BankEntry:
    """One aot_autograd compilation of a partition (one graph-bank key) and its forward/backward/inference
    graph families (which aot creates through our compilers)."""

    def __init__(self, part: Any, args: Sequence[Any]):
        self.part = part
        self.forward: Optional[GraphFamily] = None
        self.backward: Optional[GraphFamily] = None
        self.inference: Optional[GraphFamily] = None
        with preserved_global_state():  # tracing runs the partition's grad-mode/vmap switches for real
            self.fn = _compat.aot_compile(part.traced, args, self._runner,
                                          inductor=str(part.config.inner_compiler) == "inductor")

    def _runner(self, kind: str, run: Callable[[list], Any], gm: fx.GraphModule) -> Callable[[list], Any]:
        """Called by aot for each graph it compiles: what aot runs instead of it."""
        if str(self.part.config.inner_compiler) != "inductor":  # Inductor lays out its own buffers
            run = keep_traced_strides(gm, run, f"{self.part.name} {kind}")
        family = GraphFamily(self, kind, run, mutated_inputs(gm))
        setattr(self, kind, family)

        def run_family(args: list) -> Any:
            return family(args)

        return run_family

    def discard(self) -> None:
        for family in (self.forward, self.inference):
            if family is not None:
                family.discard()

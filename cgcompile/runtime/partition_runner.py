"""The local runtime, per partition: each captured partition runs as forward/backward (or inference) graphs.

Per partition, aot_autograd (run lazily at the first call of each input signature, with the real tensors)
splits the submodule into functional aten forward and backward graphs, each run by a `GraphFamily`
(graph_family.py: one `BankEntry` per graph-bank key). This module is the partition's side: `PartitionRunner`
(the graph bank and its policy, output arenas for varying sizes, eager fallback) and `compile_partition`, the
entry point.

The rules they follow live next to the code that keeps them: the buffer rules (static, borrowed and owned
inputs, aliased outputs, busy graphs and their instances, backward instances, stolen grads, inputs a graph
writes) in graph.py's docstring, with `GraphInstance`; the memory-pool rules, the registry of static memory
and the list of live graphs in ModelRuntime (model_runtime.py).
"""

from __future__ import annotations

import collections
import logging
import os
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..counters import add as count, record
from . import bank_policy
from .arena import ArenaGroup
from .driver import Driver
from .graph import GraphInstance, is_static_tensor, storage_ptr
from .graph_family import BankEntry
from .model_runtime import ModelRuntime
from .subclasses import inner_tensors

__all__ = ["PartitionRunner", "compile_partition"]

log = logging.getLogger("cgcompile")


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


class PartitionRunner:
    """The callable compile_partition returns for one captured partition: graph bank, warmup/capture,
    permanent eager fallback. (`Partition` is the plan's record of the same partition, plan.py.)"""

    def __init__(self, submod: fx.GraphModule, name: str, static_input_indices: Sequence[int],
                 runtime: ModelRuntime, location: Optional[str], driver: Driver, frame: Optional[str] = None,
                 input_names: Sequence[str] = (), sized: bool = False):
        self.submod = submod
        self.input_names = list(input_names)  # per submod input, how logs name it (see input_description)
        self.name = name
        self.location = location
        self.static_indices = frozenset(static_input_indices)
        self.runtime = runtime
        self.config = runtime.config
        self.driver = driver
        self.container, self.traced = _tuple_returning(submod)
        self.bank: Dict[Any, BankEntry] = {}
        # Forward/inference instances captured, over all bank keys, per parameter set: Dynamo reuses one
        # compiled frame for every layer of a model that graph-breaks inside its layers, so one partition
        # may serve many parameter sets, each needing graphs of its own (as Megatron has per layer).
        self.graph_counts: Dict[frozenset, int] = {}
        self.broken: Optional[str] = None
        self._warned: set = set()
        self._args: Optional[Sequence[Any]] = None
        # The bank policy's state (bank_policy.py): accounting, its clock (forward/inference calls), the next
        # sweep of stale graphs, the captures not yet judged, oldest first.
        self.counters = bank_policy.BankCounters()
        self.tick = 0
        self.next_sweep = 0
        self.unjudged: "collections.deque[Tuple[int, weakref.ref]]" = collections.deque()
        self.frame = frame or (os.path.basename(location) if location else "?")
        self._param_set_ids: Dict[frozenset, int] = {}
        self._serial = 0
        # Input sizes that vary (symbolic in the trace): graphs of one kind and parameter set write their outputs
        # into shared output arenas (arena.py), so memory follows the largest size, not the number of sizes.
        self.sized = sized
        self._arena_groups: Dict[Tuple[str, frozenset], ArenaGroup] = {}
        runtime.add_runner(self)

    def __call__(self, *args: Any) -> Any:
        if self.broken is not None:
            return self.submod(*args)
        key = self._key(args)
        entry = self.bank.get(key)
        if entry is None:
            if self.counters.stopped is None:
                self._new_size()
            if self.counters.stopped is not None:  # no compile for a size that will not be captured
                self.counters.calls += 1
                self.counters.misses += 1
                return self.submod(*args)
            try:
                entry = self.bank[key] = BankEntry(self, args)
            except Exception as exc:
                self.fail(f"compiling it failed: {type(exc).__name__}: {exc}")
                return self.submod(*args)
        self._args = args
        try:
            out = entry.fn(*args)
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
        static tensors, and the submodule's own parameters/buffers (aot passes those first); of a wrapper
        parameter (DTensor), its inner tensors' storages, which are what aot hands the graphs."""
        found = set()
        args = self._args or ()
        for index, arg in enumerate(args):
            if is_static_tensor(arg) or (isinstance(arg, torch.Tensor) and index in self.static_indices):
                found.update(storage_ptr(inner) for inner in inner_tensors(arg))
        for tensor in list(self.submod.parameters()) + list(self.submod.buffers()):
            found.update(storage_ptr(inner) for inner in inner_tensors(tensor))
        found.discard(0)
        return found

    def input_names_of(self, args: Sequence[Any]) -> List[Optional[str]]:
        """Per argument of an aot graph, the name of the partition input it is (aot passes this call's
        tensors through as they are), or None (a saved tensor, a tangent, a lifted parameter)."""
        own = {id(arg): i for i, arg in enumerate(self._args or ())}
        names = self.input_names
        return [names[own[id(arg)]] if id(arg) in own and own[id(arg)] < len(names) else None for arg in args]

    def arena_group(self, kind: str, param_storages: frozenset) -> ArenaGroup:
        """The output arenas of this partition's `kind` graphs for one parameter set."""
        key = (kind, param_storages)
        if key not in self._arena_groups:
            params = self._param_set_ids.setdefault(param_storages, len(self._param_set_ids))
            self._arena_groups[key] = ArenaGroup(f"{self.name} params {params} {kind}", self.driver.new_pool)
        return self._arena_groups[key]

    def bank_size(self) -> int:
        """How many input signatures (graph-bank keys) have a compiled entry now."""
        return len(self.bank)

    def describe(self) -> str:
        return f"partition {self.name}" + (f" ({self.location})" if self.location else "")

    def graph_name(self, args: Sequence[Any], param_storages: frozenset) -> str:
        """A unique, readable name for a new forward/inference graph (its backward's label starts with it):
        partition, frame, the shapes of its non-parameter inputs, which parameter set, a serial number."""
        params = self._param_set_ids.setdefault(param_storages, len(self._param_set_ids))
        self._serial += 1
        shapes: List[str] = []
        for index, arg in enumerate(args):
            if isinstance(arg, torch.Tensor) and index not in self.static_indices and not is_static_tensor(arg):
                shape = "x".join(map(str, arg.shape)) or "()"
                if shape not in shapes:
                    shapes.append(shape)
        sizes = ",".join(shapes[:3]) + (",..." if len(shapes) > 3 else "")
        return f"{self.name} in {self.frame} [{sizes}] params {params} #{self._serial}"

    # the bank policy (bank_policy.py) -------------------------------------------------------------------------

    def live_graphs(self) -> int:
        """Forward/inference instances alive now: the policy's clock counts calls per live graph."""
        return sum(self.graph_counts.values())

    def _new_size(self) -> None:
        """A call brought an input signature never seen: stop capturing new sizes if most calls do."""
        counters, cap = self.counters, self.config.max_graphs_per_partition
        counters.sizes += 1
        if bank_policy.new_sizes_keep_coming(counters.sizes, counters.calls + 1, cap):
            self.stop(f"{counters.sizes} distinct input sizes in its first {counters.calls + 1} calls, more than "
                      f"max_graphs_per_partition={cap} could hold")

    def judge(self) -> None:
        """Judge the captures old enough (bank_policy.is_judged): a graph never replayed is released as wasted;
        stop capturing new sizes when most were (bank_policy.sizes_do_not_repeat)."""
        if not self.unjudged:
            return
        graphs = self.live_graphs()
        wasted = []
        while self.unjudged and bank_policy.is_judged(self.unjudged[0][0], self.tick, graphs):
            graph = self.unjudged.popleft()[1]()
            if graph is None or graph.captured is None:
                continue
            self.counters.judged += 1
            if graph.replays <= 1:  # its only replay was the capture's own
                self.counters.wasted += 1
                wasted.append(graph)
        self.release_graphs(wasted, f"never replayed within {bank_policy.JUDGE_AFTER} calls per live graph of "
                                    f"its capture")
        counters = self.counters
        if counters.stopped is None and bank_policy.sizes_do_not_repeat(counters):
            self.stop(f"{counters.wasted} of its {counters.judged} graphs judged so far were never replayed after "
                      f"their capture")

    def sweep(self) -> None:
        """Release the graphs not used within the window (bank_policy.is_stale); runs every window's calls."""
        window, graphs = bank_policy.RELEASE_WINDOW, self.live_graphs()
        self.next_sweep = self.tick + window  # a sweep is a pass over the live graphs: not on every call
        stale = [graph for entry in self.bank.values() for family in (entry.forward, entry.inference)
                 if family is not None for graph in family.graphs
                 if bank_policy.is_stale(graph.last_use, self.tick, graphs)]
        self.release_graphs(stale, f"not replayed in its last {window} calls per live graph")

    def release_graphs(self, graphs: List[GraphInstance], why: str) -> None:
        """Release idle forward/inference instances with their backward graphs, or a backward graph alone (a busy
        one is kept: its outputs or stolen grads are in use): memory returned, counted, the partition's first
        release logged."""
        released = 0
        for graph in graphs:
            if graph.captured is None or graph.busy() or (graph.bw is not None and graph.bw.busy()):
                continue
            if graph.kind == "backward":  # alone (arena.py): its forward instance captures it again when needed
                graph.owner.entry.forward.drop_backward(graph)
            else:
                graph.owner.graphs.remove(graph)
                self.graph_counts[graph.param_storages] -= 1
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
        """Release the graphs of the idle arenas a larger size superseded (arena.py): each size captures again into
        a full-size arena at its next call."""
        self.release_graphs([graph for arena in group.superseded_idle() for graph in arena.member_graphs()],
                            "a larger input size needs more output memory: its size captures again into the "
                            "larger output arena")

    def stop(self, reason: str) -> None:
        """Stop capturing new sizes for good: log once with the fix, count, release the graphs never replayed.
        The graphs it keeps still replay; other sizes run eagerly."""
        self.counters.stopped = (f"{reason}: its input sizes do not repeat (e.g. rows selected by nonzero before a "
                                 f"graph break); new sizes run eagerly, the graphs it has keep replaying. "
                                 f"{_FIX_HINT}")
        log.warning("cgcompile: %s stops capturing new sizes: %s", self.describe(), self.counters.stopped)
        record("bank_stops", self.name, self.counters.stopped, once=True)
        self.release_graphs([graph for entry in self.bank.values() for family in (entry.forward, entry.inference)
                             if family is not None for graph in family.graphs if graph.replays <= 1],
                            "never replayed")

    def fail(self, reason: str, storm: bool = False) -> None:
        """Fall back to eager for good: log once, count (a re-capture storm in stats()["bank_stops"], other
        causes in "eager_fallbacks"), release graphs. The current call still completes."""
        if self.broken is not None:
            return
        self.broken = reason
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
        for entry in self.bank.values():
            entry.discard()
        self.bank, self.graph_counts = {}, {}
        self._arena_groups = {}
        self.counters = bank_policy.BankCounters()
        self.unjudged.clear()

    def eager_call(self, reason: str) -> None:
        """One call runs eagerly (bank full): log and count once per partition and reason."""
        record("eager_fallbacks", self.name, reason, once=True)
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("cgcompile: %s: %s", self.describe(), reason)


_FIX_HINT = ("Fix: dynamic_padding='buckets' (or 'max') with torch._dynamo.config.capture_dynamic_output_shape_ops="
             "True when the sizes come from nonzero or a boolean mask, or capture_sizes=[...] when they are a batch "
             "dimension.")


def compile_partition(submod: fx.GraphModule, example_inputs: Sequence[Any], *, name: str,
                      static_input_indices: Sequence[int], runtime: ModelRuntime,
                      location: Optional[str] = None, frame: Optional[str] = None,
                      input_names: Sequence[str] = ()) -> Callable[..., Any]:
    """Wrap one captured partition of a split Dynamo graph.

    Returns a callable with submod's calling convention (positional args; returns what submod returns).
    It compiles and captures lazily, at run time, with real tensors. `static_input_indices` are the
    positions of parameters/buffers (nn.Parameter arguments and tensors Dynamo marked with
    `_dynamo_static_input_type` count as static too). `location` ("file:line") goes into fallback warnings,
    `frame` (the Dynamo frame's function and file:line) into the graphs' labels.
    `input_names` (per submod input) into a failed capture's reason. A partition with a symbolic size among its
    example inputs (its sizes vary) shares output memory across sizes (arena.py).
    When nothing would be captured or compiled (eager driver and eager inner compiler), submod itself is
    returned: the cheapest host path.
    """
    driver = runtime.driver_for(example_inputs)
    if not driver.captures and str(runtime.config.inner_compiler) == "eager":
        return submod
    sized = any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(
        isinstance(d, torch.SymInt) for d in v.shape)) for v in example_inputs)
    return PartitionRunner(submod, name, static_input_indices, runtime, location, driver, frame, input_names, sized)

"""Collectives traced by Dynamo, classified by whether their shapes are fixed.

What reaches the graph (torch 2.13): Dynamo rewrites the c10d in-place APIs (`dist.all_reduce`,
`dist.all_to_all_single`, `dist.all_gather_into_tensor`, `dist.reduce_scatter_tensor`, ...) into functional
collectives through `torch.distributed._functional_collectives.traceable_collective_remaps`, so the graph holds
`_c10d_functional.<op>` (or `_c10d_functional_autograd.<op>`) nodes, each followed by a
`_c10d_functional.wait_tensor` and, for the in-place APIs, a `copy_` into the caller's tensor.

- Fixed shapes (all_reduce of a fixed tensor, all_to_all_single with equal or constant splits): capturable,
  NCCL supports collectives inside CUDA graphs.
- Split sizes or shapes that depend on tensor data (expert-parallel dispatch: counts -> `.tolist()` ->
  `all_to_all_single(x, out_splits, in_splits)`): the sizes are unbacked symbols (u0, ...) that change every
  step, and a graph fixes them at capture, so the collective and the `wait_tensor` that completes it stay eager.
  The finding names the collective's line and, in its detail, where the split sizes came from (the `.tolist()`).

- Split sizes that arrive as symbolic Python ints (with default Dynamo flags the `.tolist()` is a graph break;
  the next graph receives the sizes as int inputs, constants on its first compile and symbols s0, ... once they
  changed): eager too, rather than one graph per split combination.
- Sizes derived from the shapes of dynamic tensor inputs (dynamic=True, equal splits of a dynamic batch) are
  backed: known on entry, capturable once per size in the graph bank like any other backed shape.

`find_data_dependent_collectives(gm) -> {node: [Finding]}` is the pass; `is_collective(node)` the predicate;
`collective_counts(gm)` what a graph runs (the runtime reports it per captured graph).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch
import torch.fx as fx

from ..reasons import Finding, Reason
from .common import (compute_nodes, example_value, input_unbacked_symbols, node_location, node_module_path, op_name,
                     short_location, unbacked_symbols)

_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d"})
_WAIT_OPS = frozenset({"wait_tensor"})
_HINT = ("pad every rank's tokens to a fixed capacity (drop-and-pad dispatch) so the split sizes are static, "
         "or leave the dispatch eager")
_WAIT_HINT = "it completes a collective with data-dependent sizes; it stays eager with it"
_GRAPH_BREAK_HINT = ("; with torch._dynamo.config.capture_scalar_outputs=True the .tolist() is traced and the "
                     "dispatch is planned as one eager island")


def _finding(node: fx.Node, hint: str, detail: str) -> Finding:
    return Finding(Reason.COLLECTIVE, op_name(node), node_location(node), node_module_path(node), hint, detail)


def _namespace_and_name(target) -> tuple:
    """('_c10d_functional', 'all_to_all_single') for an op overload or packet; (None, None) otherwise.

    An OpOverloadPacket has no `namespace` attribute (attribute lookup on a packet looks for an overload of that
    name and raises), so read its qualified name instead."""
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace, target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, _, name = target._qualified_op_name.partition("::")
        return namespace, name
    return None, None


def is_collective(node: fx.Node) -> bool:
    """Whether the node runs a c10d collective (functional or not, `wait_tensor` included)."""
    if node.op != "call_function":
        return False
    namespace, _ = _namespace_and_name(node.target)
    if namespace is not None:
        return namespace in _NAMESPACES
    module = getattr(node.target, "__module__", "") or ""
    # DTensor's API (from_local, ...) is not a collective; its redistributions are read by dtensor.py
    return module.startswith("torch.distributed") and not module.startswith("torch.distributed.tensor")


def is_wait(node: fx.Node) -> bool:
    _, name = _namespace_and_name(node.target)
    return is_collective(node) and name in _WAIT_OPS


def collective_counts(gm: fx.GraphModule) -> Dict[str, int]:
    """How many of each collective gm runs, by op name without its namespace ({"all_reduce": 2}), waits left out:
    for an aot graph, the collectives DTensor lowered its redistributions to. An in-place variant counts as its
    collective (torch 2.11's graphs hold `all_reduce_` where 2.13's hold `all_reduce`)."""
    counts: Dict[str, int] = {}
    for node in gm.graph.nodes:
        if is_collective(node) and not is_wait(node):
            name = _namespace_and_name(node.target)[1] or op_name(node)
            name = name.removesuffix("_")
            counts[name] = counts.get(name, 0) + 1
    return counts


def _flat(values: Iterable) -> Iterable:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _flat(value)
        else:
            yield value


def _symbol_origins(gm: fx.GraphModule) -> Dict[object, fx.Node]:
    """unbacked symbol -> the first node whose output has it and none of whose inputs do (e.g. the `.item()`
    Dynamo emits for each element of a `.tolist()`)."""
    origins: Dict[object, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        for sym in unbacked_symbols(example_value(node), input_unbacked_symbols(node)):
            origins.setdefault(sym, node)
    return origins


def _size_args(node: fx.Node) -> Iterable:
    """The collective's non-tensor arguments (split sizes, group sizes...), flattened; SymInt nodes included."""
    for arg in _flat(list(node.args) + list(node.kwargs.values())):
        value = example_value(arg) if isinstance(arg, fx.Node) else arg
        if not isinstance(value, torch.Tensor):
            yield value


def _data_symbols(node: fx.Node) -> set:
    """Unbacked symbols in the collective's arguments (split sizes, input shapes) and its output shape."""
    symbols = unbacked_symbols(example_value(node))
    for arg in _flat(list(node.args) + list(node.kwargs.values())):
        symbols |= unbacked_symbols(example_value(arg) if isinstance(arg, fx.Node) else arg)
    return symbols


def _free_symbols(value) -> set:
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    if isinstance(value, torch.Tensor):
        symbols: set = set()
        sizes = list(value.shape) + (list(value.stride()) if value.layout == torch.strided else [])
        for size in sizes:
            symbols |= _free_symbols(size)
        return symbols
    return set()


def _scalar_input_symbols(gm: fx.GraphModule) -> set:
    """Symbols of Python ints the graph takes as inputs: Dynamo makes an int local symbolic when it saw its
    value change between calls. Dynamo also lifts the size symbols of dynamic tensor inputs as SymInt
    placeholders; those are tensor shapes (capturable per size), not ints, and are left out."""
    scalars: set = set()
    shapes: set = set()
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = example_value(node)
        if isinstance(value, torch.SymInt):
            scalars |= _free_symbols(value)
        elif isinstance(value, torch.Tensor):
            shapes |= _free_symbols(value)
    return scalars - shapes


def _input_split_symbols(node: fx.Node, scalar_symbols: set) -> set:
    """Symbols of the collective's size arguments that come from Python-int graph inputs."""
    symbols: set = set()
    for value in _size_args(node):
        symbols |= _free_symbols(value) & scalar_symbols
    return symbols


def _describe_origins(symbols: set, origins: Dict[object, fx.Node]) -> str:
    names = ", ".join(sorted(str(s) for s in symbols))
    sources: Dict[str, None] = {}
    for sym in sorted(symbols, key=str):
        origin = origins.get(sym)
        if origin is not None:
            location = node_location(origin)
            where = short_location(location) if location else origin.name
            sources.setdefault(f"{op_name(origin)} at {where}")
    text = f"split sizes or shapes depend on tensor data ({names})"
    return text + (f", from {'; '.join(sources)}" if sources else "")


def _collective_of_wait(node: fx.Node) -> Optional[fx.Node]:
    source = node.args[0] if node.args else node.kwargs.get("input")
    return source if isinstance(source, fx.Node) else None


def find_data_dependent_collectives(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    """Collectives (and the waits that complete them) whose split sizes or shapes are data-dependent.

    Two cases: (1) sizes with unbacked symbols (a `.tolist()` traced with capture_scalar_outputs=True);
    (2) split sizes that enter the graph as Python ints which Dynamo made symbolic because they changed
    between calls, the shape of a `.tolist()` that ended the previous graph (a Dynamo graph break): every
    new combination would need its own graph. Fixed and constant sizes, and tensors whose shapes are backed
    dynamic sizes (dynamic=True), are capturable."""
    origins: Optional[Dict[object, fx.Node]] = None
    scalar_symbols = _scalar_input_symbols(gm)
    found: Dict[fx.Node, List[Finding]] = {}
    for node in compute_nodes(gm):
        if not is_collective(node):
            continue
        if is_wait(node):
            source = _collective_of_wait(node)
            if source in found:
                found[node] = [_finding(node, _WAIT_HINT, f"waits for {source.name} ({op_name(source)}), a "
                                                          f"collective with data-dependent sizes")]
                continue
        hint = _WAIT_HINT if is_wait(node) else _HINT
        symbols = _data_symbols(node)
        if symbols:
            if origins is None:
                origins = _symbol_origins(gm)
            found[node] = [_finding(node, hint, _describe_origins(symbols, origins))]
            continue
        inputs = _input_split_symbols(node, scalar_symbols)
        if inputs:
            names = ", ".join(sorted(str(s) for s in inputs))
            found[node] = [_finding(
                node, hint + _GRAPH_BREAK_HINT,
                f"split sizes come into the graph as symbolic Python ints ({names}), not from tensor shapes: "
                f"typically a .tolist() before a Dynamo graph break, different every step; each new combination "
                f"would need its own graph")]
    return found

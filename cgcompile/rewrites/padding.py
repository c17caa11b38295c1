"""dynamic_padding: make the rows selected by a data-dependent index op capturable, exactly.

An index producer (`nonzero`, `argwhere`, `torch.where(mask)`, `x[mask]`) has a data-dependent row count u0, so
everything it feeds (in a MoE: gather, expert MLP, weighting, index_add) is normally an eager island. When
passes/row_flow.py proves those rows flow only through row-wise ops into sum-like sinks, the producer is
rewritten to a fixed row count with padding rows that index 0 (always in range), and each sink's padded
operand is masked with a select (`torch.where(valid, x, 0)`: a multiply would turn inf into nan). Padded rows
therefore add exactly zero to every output and every gradient (the backward of a select, gather or index_add
is again a select, index_add or gather over the same rows).

- "max": `nonzero_static(size=numel)` plus a device-side count: no host sync at all.
- "buckets": `cgcompile::nonzero_bucketed` reads a count on the host once (as eager nonzero does) and pads to
  the next bucket; the rows' size is then known when the next partition starts, so it is captured once per
  bucket (a size the graph bank keys on, like a backed dynamic size). Producers whose masks are ready before
  the first of them runs (a MoE layer's expert loop: `mask[e]` of one routing result) are hoisted into one
  call that reads only their largest count and pads all of them to its bucket: one host read per layer, one
  eager island, and one graph per bucket for the whole expert loop instead of one per expert and size.
A producer that cannot be padded keeps its eager island, with a `not_paddable` finding naming the op that
prevents it. With dynamic_padding "off" nothing is rewritten, but paddable producers are marked so the plan
can say that padding would capture them.

Transforms the graph in place (before planning); fake values are then re-propagated so every later pass sees
the new, static shapes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..config import CudaGraphConfig, DynamicPadding
from ..passes.common import (compute_nodes, example_value, has_tag, input_unbacked_symbols, node_location,
                            node_module_path, op_key, op_name, unbacked_symbols, view_root, written_args)
from ..passes.padding_marks import BUCKETED_OP_NAME, NOT_PADDABLE, PADDABLE, PADDED
from ..passes.row_flow import RowFlow, row_flow
from ..reasons import Finding, Reason

__all__ = ["Padding", "bucket_for", "nonzero_bucketed", "pad_dynamic_rows"]

_META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack", "original_aten", "from_node")


@dataclass(frozen=True)
class Padding:
    """What a rewrite did to one producer: mode, its static upper bound, the buckets ("buckets" mode)."""

    mode: str
    bound: int
    buckets: Tuple[int, ...] = ()
    op: str = ""  # the producer's op, as plans name ops ("torch.nonzero")
    location: str = ""  # its user file:line
    producer: str = ""  # the producer's node name: one loop line makes several producers
    group: int = 1  # "buckets": how many producers share its host read and bucket

    @property
    def origin(self) -> str:
        return f"{self.op} at {self.location or '?'}"


# --- the bucketed producer -----------------------------------------------------------------------------------


def bucket_for(count: int, bound: int, buckets: Sequence[int]) -> int:
    """The padded row count for `count` selected rows: the smallest bucket >= count (powers of two when no
    buckets are given), never above the static bound."""
    if buckets:
        size = next((b for b in buckets if b >= count), bound)
    else:
        size = 1
        while size < count:
            size *= 2
    return min(size, bound)


@torch.library.custom_op(BUCKETED_OP_NAME, mutates_args=())
def nonzero_bucketed(masks: List[torch.Tensor], buckets: List[int]) -> List[torch.Tensor]:
    """torch.nonzero of each mask, padded with zero rows to one common size: the bucket of the largest count.
    One host read (the largest count), as one eager nonzero; the per-mask work stays on the device."""
    if all(m.shape == masks[0].shape for m in masks):
        counts = torch.stack(masks).flatten(1).count_nonzero(1)
    else:
        counts = torch.stack([m.count_nonzero() for m in masks])
    largest = int(counts.max())  # the host read
    size = bucket_for(largest, max(m.numel() for m in masks), buckets)
    return [torch.nonzero_static(m, size=size, fill_value=0) for m in masks]


@nonzero_bucketed.register_fake
def _(masks: List[torch.Tensor], buckets: List[int]) -> List[torch.Tensor]:
    rows = torch.library.get_ctx().new_dynamic_size()  # one size for all: one graph per bucket downstream
    return [m.new_empty((rows, m.dim()), dtype=torch.long) for m in masks]


BUCKETED_OP = torch.ops.cgcompile.nonzero_bucketed.default


# --- finding producers ---------------------------------------------------------------------------------------


@dataclass
class _Producer:
    node: fx.Node
    source: fx.Node  # the tensor whose nonzero entries are found (the mask)
    form: str  # "rows" (nonzero/argwhere: (n, ndim)), "tuple" (where(mask), nonzero(as_tuple=True)), "mask"
    symbol: Any


def _new_unbacked(node: fx.Node) -> set:
    return unbacked_symbols(example_value(node), input_unbacked_symbols(node))


def _producer(node: fx.Node) -> Optional[_Producer]:
    if node.op not in ("call_function", "call_method"):
        return None
    name = op_key(node)
    args = node.args
    new = _new_unbacked(node)
    if len(new) != 1 or not args or not isinstance(args[0], fx.Node):
        return None
    symbol = next(iter(new))
    if name in ("nonzero", "argwhere"):
        as_tuple = node.kwargs.get("as_tuple", args[1] if len(args) > 1 and name == "nonzero" else False)
        if set(node.kwargs) - {"as_tuple"}:
            return None
        return _Producer(node, args[0], "tuple" if as_tuple else "rows", symbol)
    if name == "where" and len(args) == 1 and not node.kwargs:
        return _Producer(node, args[0], "tuple", symbol)
    if node.target is operator.getitem and len(args) == 2 and isinstance(args[1], fx.Node):
        index = example_value(args[1])
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            return _Producer(node, args[1], "mask", symbol)
    return None


# --- the rewrite ---------------------------------------------------------------------------------------------


def _copy_meta(new: fx.Node, like: fx.Node, padding: Optional[Padding]) -> fx.Node:
    for key in _META_KEYS:
        if key in like.meta:
            new.meta[key] = like.meta[key]
    if padding is not None:
        new.meta[PADDED] = padding
    return new


def _not_paddable(producer: _Producer, blocker: Finding) -> Finding:
    node = producer.node
    return Finding(Reason.NOT_PADDABLE, blocker.op, blocker.location, blocker.module, hint=blocker.hint,
                   detail=f"{op_name(node)} at {node_location(node) or '?'} stays eager: {blocker.detail}")


def _hoistable(producer: _Producer, first: fx.Node, nodes: List[fx.Node],
               position: Dict[fx.Node, int]) -> Optional[List[fx.Node]]:
    """The nodes computing producer's mask that come after `first` (in order), if they can all run before it:
    pure, not random, not data-dependent, and reading nothing written in between; else None."""
    start, end = position[first], position[producer.node]
    chain, stack, seen = [], [producer.source], set()
    while stack:
        node = stack.pop()
        if node in seen or position.get(node, -1) < start:
            continue
        seen.add(node)
        if node.op not in ("call_function", "call_method") or written_args(node) or _new_unbacked(node) \
                or has_tag(node, torch.Tag.nondeterministic_seeded):
            return None
        chain.append(node)
        stack.extend(node.all_input_nodes)
    written = {view_root(w) for n in nodes[start:end] for w in written_args(n)}
    if any(view_root(arg) in written for node in chain for arg in node.all_input_nodes):
        return None
    return sorted(chain, key=position.__getitem__)


_Todo = Tuple[_Producer, RowFlow, int]  # a paddable producer, its row flow, its static bound


def _bucket_groups(gm: fx.GraphModule, todo: List[_Todo]) -> List[Tuple[List[_Todo], List[fx.Node]]]:
    """Split the (graph-ordered) bucketed producers into runs that can share one host read: each joins the
    current run when its mask can be computed before the run's first producer. Per run: its producers, and
    the nodes to move before the first one (found on the unchanged graph, in graph order)."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    groups: List[Tuple[List[_Todo], List[fx.Node]]] = []
    for item in todo:
        chain = None
        if groups:
            members, hoist = groups[-1]
            first = members[0][0].node
            chain = _hoistable(item[0], first, nodes, position)
        if chain is None:
            groups.append(([item], []))
        else:
            members.append(item)
            hoist.extend(node for node in chain if node not in hoist)  # masks may share nodes
    return [(members, sorted(hoist, key=position.__getitem__)) for members, hoist in groups]


def _read_buckets(gm: fx.GraphModule, group: List[_Producer], hoist: List[fx.Node],
                  paddings: List[Padding]) -> List[Tuple[Any, Any]]:
    """Move the group's masks (`hoist`) before its first producer and read them all with one nonzero_bucketed
    call; returns each producer's (padded rows, common size)."""
    graph = gm.graph
    first = group[0].node
    for node in hoist:
        first.prepend(node)
    buckets = list(paddings[0].buckets)
    with graph.inserting_before(first):
        call = _copy_meta(graph.call_function(BUCKETED_OP, ([p.source for p in group], buckets)), first,
                          paddings[0])
        rows = [_copy_meta(graph.call_function(operator.getitem, (call, i)), p.node, padding)
                for i, (p, padding) in enumerate(zip(group, paddings))]
        size = _copy_meta(graph.call_function(torch.ops.aten.sym_size.int, (rows[0], 0)), first, paddings[0])
    return [(r, size) for r in rows]


def _rewrite(gm: fx.GraphModule, producer: _Producer, flow: RowFlow, padding: Padding,
             read: Optional[Tuple[Any, Any]] = None) -> None:
    """Replace one producer by padded rows (`read`: its bucketed rows and size; else nonzero_static to the
    bound) and mask every sink it feeds."""
    graph = gm.graph
    node, source = producer.node, producer.source
    ndim = example_value(source).dim()
    device = example_value(source).device

    def new(op, target, args, kwargs=None, like=node):
        return _copy_meta(graph.create_node(op, target, tuple(args), kwargs or {}), like, padding)

    with graph.inserting_before(node):
        if read is not None:
            rows, size = read
        else:
            rows = new("call_function", torch.nonzero_static, (source,), {"size": padding.bound, "fill_value": 0})
            size = padding.bound
        count = new("call_function", torch.count_nonzero, (source,))
        positions = new("call_function", torch.arange, (size,), {"device": device})
        valid = new("call_function", torch.lt, (positions, count))
        if producer.form == "rows":
            replacement = rows
        else:
            replacement = new("call_function", torch.unbind, (rows, 1))
            if producer.form == "mask":
                parts = tuple(new("call_function", operator.getitem, (replacement, i)) for i in range(ndim))
                replacement = new("call_function", operator.getitem, (node.args[0], parts))
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)

    for sink in flow.sinks:
        operand = sink.node.args[sink.arg]
        shape = [-1 if i == sink.dim else 1 for i in range(example_value(operand).dim())]
        with graph.inserting_before(sink.node):
            keep = new("call_method", "view", (valid, *shape), like=sink.node)
            masked = new("call_function", torch.where, (keep, operand, 0), like=sink.node)
        sink.node.update_arg(sink.arg, masked)
    for user in flow.dims:
        if user is not node and user.graph is graph:
            user.meta[PADDED] = padding
    for assert_node in reversed(flow.asserts):  # Dynamo's runtime checks on the size, which is now fixed
        if not assert_node.users:
            graph.erase_node(assert_node)


def _refresh_fake_values(gm: fx.GraphModule) -> None:
    """Re-run the graph on fake tensors so every node's example_value has the new shapes."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [example_value(n) for n in placeholders]
    mode = next(i.fake_mode for i in inputs if isinstance(i, FakeTensor))  # Dynamo's own mode and shape env
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    for node in gm.graph.nodes:
        if node.op != "placeholder" and "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]


def pad_dynamic_rows(gm: fx.GraphModule, config: CudaGraphConfig) -> Dict[str, Padding]:
    """Apply config.dynamic_padding to `gm` in place; returns {producer name: Padding} of what was rewritten.
    Producers that cannot be padded get NOT_PADDABLE (and, with "off", paddable ones PADDABLE)."""
    producers = [p for p in map(_producer, list(compute_nodes(gm))) if p is not None]
    if not producers:
        return {}
    mode = config.dynamic_padding
    flows = [(producer, row_flow(gm, producer.symbol, allow_sinks=True)) for producer in producers]
    todo: List[_Todo] = []
    for producer, flow in flows:  # every flow is found on the unchanged graph, then the rewrites run
        bound = example_value(producer.source).numel()
        if flow.ok and not isinstance(bound, int):
            flow.blocker = Finding(Reason.NOT_PADDABLE, op_name(producer.node), node_location(producer.node),
                                   node_module_path(producer.node), hint="give the mask a static shape",
                                   detail="its input has a dynamic size, so there is no static bound")
        if not flow.ok:
            producer.node.meta[NOT_PADDABLE] = _not_paddable(producer, flow.blocker)
            continue
        if mode == DynamicPadding.OFF:
            producer.node.meta[PADDABLE] = True
            continue
        todo.append((producer, flow, bound))
    bucketed = mode == DynamicPadding.BUCKETS
    groups = _bucket_groups(gm, todo) if bucketed else [([item], []) for item in todo]
    done: Dict[str, Padding] = {}
    for members, hoist in groups:
        producers = [producer for producer, _, _ in members]
        paddings = [Padding(mode.value, bound, tuple(config.dynamic_padding_buckets), op_name(p.node),
                            node_location(p.node) or "", p.node.name, len(members)) for p, _, bound in members]
        reads = _read_buckets(gm, producers, hoist, paddings) if bucketed else [None]
        for (producer, flow, _), padding, read in zip(members, paddings, reads):
            done[producer.node.name] = padding
            _rewrite(gm, producer, flow, padding, read)
    if done:
        gm.graph.lint()
        gm.recompile()
        _refresh_fake_values(gm)
    return done

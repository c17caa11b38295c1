"""An activation checkpoint node as planning sees it. Dynamo traces `torch.utils.checkpoint.checkpoint` as the
higher-order op `tag_activation_checkpoint`, its body a graph module of the frame: to the planner one node with no
module of its own. What it needs of such a node (the tags, module paths, ops and user's line inside its body, the
items taken of its result, the region it is captured whole in) is read here from the body."""

from __future__ import annotations

import operator
from typing import AbstractSet, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from .common import counts_as_op, node_location
from .regions import module_regions

__all__ = ["body_modules", "checkpoint_body", "checkpoint_location", "checkpoint_of_item", "op_count",
           "tags_inside", "whole_checkpoint_region"]


def checkpoint_body(node: fx.Node) -> Optional[fx.GraphModule]:
    """The body of an activation checkpoint node, or None for any other node."""
    if node.op == "call_function" and node.target is torch.ops.higher_order.tag_activation_checkpoint \
            and node.args and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr":
        return getattr(node.graph.owning_module, node.args[0].target)
    return None


def tags_inside(node: fx.Node) -> Tuple[str, ...]:
    """The tags of the modules a checkpoint node's body runs, in order of first use (none for any other node)."""
    body = checkpoint_body(node)
    if body is None:
        return ()
    seen: Dict[str, None] = {}
    for inner, info in module_regions(body).items():
        for _, name in info.tagged:
            seen.setdefault(name)
        seen.update(dict.fromkeys(tags_inside(inner)))
    return tuple(seen)


def checkpoint_of_item(node: fx.Node) -> Optional[fx.Node]:
    """The activation checkpoint node whose result `node` takes an item of, if it does."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and checkpoint_body(node.args[0]) is not None:
        return node.args[0]
    return None


def body_modules(node: fx.Node) -> Optional[List[Optional[str]]]:
    """The module paths of the body's nodes, for a checkpoint node or an item of one; None for any other node."""
    body = checkpoint_body(checkpoint_of_item(node) or node)
    return None if body is None else [info.module for info in module_regions(body).values()]


def op_count(node: fx.Node) -> int:
    """Ops a node runs: a checkpoint kept whole runs its body's."""
    body = checkpoint_body(node)
    return int(counts_as_op(node)) if body is None else sum(map(op_count, body.graph.nodes))


def checkpoint_location(node: fx.Node) -> Optional[str]:
    """The node's file:line; for a checkpoint Dynamo recorded none for, its body's first (the user's call)."""
    found = node_location(node)
    body = checkpoint_body(node)
    if found is None and body is not None:
        found = next((where for where in map(node_location, body.graph.nodes) if where), None)
    return found


def whole_checkpoint_region(node: fx.Node, selected: AbstractSet[str], strict_modules: bool
                            ) -> Optional[Tuple[str, str]]:
    """The (module path, tag) region a selective checkpoint holding selected modules only is captured whole in: the
    last of them, in its layer (aot_autograd applies its policy to the whole body, so it is not inlined:
    rewrites/checkpoint_inline.py). None for any other node, and with strict_modules (the body's glue would be
    captured too)."""
    inside = set(tags_inside(node))
    if not inside or not inside <= selected or strict_modules:
        return None
    found = [info.innermost_tag(selected) for info in module_regions(checkpoint_body(node)).values()]
    return next((region for region in reversed(found) if region is not None), None)

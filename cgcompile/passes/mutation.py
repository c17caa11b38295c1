"""In-place mutation of a graph input that is not a parameter or buffer.

A captured graph writes into its own static copy of such an input, so the caller's tensor would need a copy-back
after every replay; we keep the op eager instead and say which input it mutates.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional

import torch
import torch.fx as fx

from .common import Finding, compute_nodes, finding, is_static_placeholder

_VIEW_METHODS = {"view", "reshape", "view_as", "transpose", "permute", "squeeze", "unsqueeze", "narrow",
                 "select", "expand", "t", "flatten", "unflatten", "as_strided", "__getitem__", "detach"}


def _mutated_arg(node: fx.Node) -> Optional[fx.Node]:
    """The tensor an in-place op writes to, if this node is one."""
    if node.op == "call_method" and isinstance(node.target, str):
        name = node.target
        if name.endswith("_") and not name.endswith("__") and node.args:
            return node.args[0] if isinstance(node.args[0], fx.Node) else None
        return None
    if node.target is operator.setitem and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
        for arg, schema_arg in zip(node.args, node.target._schema.arguments):
            if schema_arg.alias_info is not None and schema_arg.alias_info.is_write and isinstance(arg, fx.Node):
                return arg
        return None
    name = getattr(node.target, "__name__", "")
    if node.op == "call_function" and name.endswith("_") and not name.endswith("__") \
            and getattr(torch, name, None) is node.target and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if node.kwargs.get("out") is not None and isinstance(node.kwargs["out"], fx.Node):
        return node.kwargs["out"]
    return None


def _view_root(node: fx.Node) -> fx.Node:
    """Follow views back to the tensor that owns the memory."""
    while True:
        is_view = (node.op == "call_method" and node.target in _VIEW_METHODS) or node.target is operator.getitem
        if not is_view or not node.args or not isinstance(node.args[0], fx.Node):
            return node
        node = node.args[0]


def find_input_mutations(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    found: Dict[fx.Node, List[Finding]] = {}
    for node in compute_nodes(gm):
        target = _mutated_arg(node)
        if target is None:
            continue
        root = _view_root(target)
        if root.op == "placeholder" and not is_static_placeholder(root):
            found[node] = [finding(node, "input_mutation",
                                   detail=f"mutates graph input '{root.target}' in place (needs a copy-back)",
                                   hint="mutate a clone, or register the tensor as a module buffer so it is static")]
    return found

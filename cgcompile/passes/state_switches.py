"""Nodes that change thread-local global state (grad mode, autocast, functorch transform levels).

Dynamo records a `with torch.no_grad():` block, an autocast block or a vmap (inside `associative_scan`, say) as
paired enter/exit nodes around the ops they govern. A partition boundary must never leave such a pair half
open: the partition traced, captured or replayed alone would leave the state changed for whoever runs next.
The planner uses this module to place state nodes with the ops they govern (they are not ops of their own,
so they never make islands) and to keep each functorch level, which cannot be re-entered, in one partition.
Grad mode and autocast can be re-entered: split.py closes them at each partition's end.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.fx as fx

from .common import compute_nodes

# How a node changes global state: "set" (grad mode: takes effect for the ops after it), "enter" / "exit"
# (a paired block).
_GRAD_SET = {torch._C._set_grad_enabled}
_AUTOCAST = {torch.amp._enter_autocast: "enter", torch.amp._exit_autocast: "exit"}
_FUNCTORCH_NAMES = {
    "_vmap_increment_nesting": "enter", "_vmap_decrement_nesting": "exit",
    "_grad_increment_nesting": "enter", "_grad_decrement_nesting": "exit",
    "_jvp_increment_nesting": "enter", "_jvp_decrement_nesting": "exit",
    "_func_increment_nesting": "enter", "_func_decrement_nesting": "exit",
}


def functorch_effect(node: fx.Node) -> Optional[str]:
    """"enter"/"exit" for a functorch level push/pop (Dynamo records them from torch._functorch.predispatch or
    torch._C._functorch, depending on the version), else None."""
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", None)
    module = getattr(node.target, "__module__", "") or ""
    if name in _FUNCTORCH_NAMES and ("functorch" in module or module == "torch._C._functorch"):
        return _FUNCTORCH_NAMES[name]
    return None


def state_effect(node: fx.Node) -> Optional[str]:
    """"set", "enter" or "exit" when the node only changes global state; None for ordinary ops."""
    if node.op != "call_function":
        return None
    if node.target in _GRAD_SET:
        return "set"
    if node.target in _AUTOCAST:
        return _AUTOCAST[node.target]
    return functorch_effect(node)


def is_state_node(node: fx.Node) -> bool:
    return state_effect(node) is not None


def functorch_spans(gm: fx.GraphModule) -> List[List[fx.Node]]:
    """The outermost functorch levels of the graph, each as the list of compute nodes from its push to its
    matching pop (both included). A level must run inside one partition: its ops read the level number the
    push returned, and a pop in another partition would leave the level open after this one."""
    spans: List[List[fx.Node]] = []
    depth = 0
    for node in compute_nodes(gm):
        effect = functorch_effect(node)
        if effect == "enter":
            if depth == 0:
                spans.append([])
            depth += 1
        if depth:
            spans[-1].append(node)
        if effect == "exit" and depth:
            depth -= 1
    return spans


def grad_mode_after(gm: fx.GraphModule, entry: bool) -> Dict[fx.Node, bool]:
    """Grad mode in effect after each node of `gm` when it is entered with grad mode `entry` (Dynamo guards
    on grad mode, so the mode at every node of a graph is known statically)."""
    mode = entry
    after: Dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _GRAD_SET and isinstance(node.args[0], bool):
            mode = node.args[0]
        after[node] = mode
    return after

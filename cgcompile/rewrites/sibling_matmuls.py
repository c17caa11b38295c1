"""Matmuls that read one tensor moved side by side, so a layer cut can keep them together.

An attention reads its normed input with three projections, `q_proj(h).view(...).transpose(1, 2)`, then k's,
then v's: in Dynamo's graph the views of q sit between q's matmul and k's. The layer cut of a training graph
(planner._cut_before_matmuls) puts those matmuls in the graph that makes their input, which it can only do for
a contiguous run of nodes: split_module wants each partition's nodes in one piece where grad-mode or autocast
nodes are present. A matmul depends only on its operands, so it may run earlier, right after its first sibling,
as long as its operands exist by then and nothing in between writes memory or changes global state.
"""

from __future__ import annotations

import torch.fx as fx

from ..passes.common import MATMULS, op_name, written_args
from ..passes.state_switches import is_state_node

__all__ = ["group_sibling_matmuls"]


def group_sibling_matmuls(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each matmul reading the same first operand as an earlier one to just after it (the previous moved
    one), where that keeps the graph's meaning. Mutates and returns `gm`."""
    moved = False
    for source in list(gm.graph.nodes):
        readers = [n for n in source.users if op_name(n) in MATMULS and n.args and n.args[0] is source]
        if len(readers) < 2:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        readers.sort(key=order.__getitem__)
        anchor = readers[0]
        for reader in readers[1:]:
            if not _movable(reader, anchor, order):
                break
            if anchor.next is not reader:
                for arg in reader.all_input_nodes:  # a weight fetched just before its use (get_attr) comes too
                    if arg.op == "get_attr" and order[arg] > order[anchor]:
                        readers[0].prepend(arg)
                anchor.append(reader)
                moved = True
                order = {n: i for i, n in enumerate(gm.graph.nodes)}
            anchor = reader
    if moved:
        gm.graph.lint()
        gm.recompile()
    return gm


def _movable(node: fx.Node, anchor: fx.Node, order: dict) -> bool:
    """May `node` run right after `anchor`: its operands made by then, and no node between them writing memory
    (the operands' or any other: a view's write is hard to trace) or switching grad mode or autocast? A weight
    read by get_attr moves along."""
    if any(order[arg] > order[anchor] and arg.op != "get_attr" for arg in node.all_input_nodes):
        return False
    between = anchor.next
    while between is not node:
        if is_state_node(between) or written_args(between) or \
                between.op not in ("call_function", "call_method", "get_attr"):
            return False
        between = between.next
    return True

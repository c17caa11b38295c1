"""Scalar-input reads hoisted to the top of the graph, where they form one eager run."""

from __future__ import annotations

import torch.fx as fx

from ..passes.common import is_scalar_input_read


def hoist_scalar_input_reads(gm: fx.GraphModule) -> fx.GraphModule:
    """Move the reads of Python-number inputs (passes/scalar_inputs.py) right after the placeholders, so they form
    one eager run at the top instead of cutting captured regions apart. They depend on placeholders only, so the
    move keeps the graph's meaning. Mutates and returns `gm`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return gm
    anchor = placeholders[-1]
    moved = False
    for node in list(gm.graph.nodes):
        if is_scalar_input_read(node):
            anchor.append(node)
            anchor = node
            moved = True
    if moved:
        gm.recompile()
    return gm

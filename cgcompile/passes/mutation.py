"""In-place mutation of a graph input that is not a parameter or buffer.

A captured graph writes into its own static copy of such an input, so the caller's tensor would need a copy-back
after every replay; we keep the op eager instead and say which input it mutates.
"""

from __future__ import annotations

from typing import Dict, List

import torch.fx as fx

from ..reasons import Finding, Reason
from .common import aten_view_root, compute_nodes, finding, is_static_placeholder, view_root, written_args

def find_input_mutations(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    found: Dict[fx.Node, List[Finding]] = {}
    for node in compute_nodes(gm):
        written = written_args(node)
        if not written:
            continue
        root = view_root(written[0])
        if root.op == "placeholder" and not is_static_placeholder(root):
            found[node] = [finding(node, Reason.INPUT_MUTATION,
                                   detail=f"mutates graph input '{root.target}' in place (needs a copy-back)",
                                   hint="mutate a clone, or make the tensor static: a module buffer, or "
                                        "torch._dynamo.mark_static_address(t) once before the first call (a cache "
                                        "the caller allocates once and passes in)")]
    return found


def mutated_inputs(gm: fx.GraphModule) -> frozenset:
    """Positions of gm's inputs that an op in gm writes (per the op schemas' alias annotations), directly or
    through a view of them (an aten graph: rewrites/input_writes.py writes a KV cache through its slice)."""
    positions = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return frozenset(positions[root] for node in gm.graph.nodes if node.op == "call_function"
                     for root in map(aten_view_root, written_args(node)) if root in positions)

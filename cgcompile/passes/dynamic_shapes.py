"""Data-dependent shapes, decided with sympy over the FakeTensor shapes Dynamo recorded.

Unbacked symbols (u0, ...) are sizes known only after the op ran: nothing whose shape involves one can be
captured (a graph fixes shapes at capture). Backed symbols (s0, ... from dynamic=True) are known on entry, so
those partitions are capturable once per concrete size, in the runtime's graph bank.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.fx as fx

from ..reasons import Finding, Reason
from .common import (compute_nodes, example_value, finding, has_tag, input_unbacked_symbols, is_scalar_input_read,
                     scalar_input_symbols, unbacked_symbols)
from .padding_marks import NOT_PADDABLE, PADDABLE, bucketed_symbols, is_bucketed_producer

_ORIGIN_HINT = "use a static-shape form (torch.nonzero_static, output_size=, or pad each group to a fixed capacity)"
_PADDABLE_HINT = ("set dynamic_padding='max' (no host sync) or 'buckets' to capture the rows it selects; "
                  "the padding is exact")


def find_data_dependent_shapes(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    found: Dict[fx.Node, List[Finding]] = {}
    origin_of: Dict[object, fx.Node] = {}  # unbacked symbol -> the node that created it
    # Python numbers passed in and bucketed row counts: known when a partition starts, like backed sizes
    known = scalar_input_symbols(gm) | bucketed_symbols(gm)
    for node in compute_nodes(gm):
        if is_scalar_input_read(node) or is_bucketed_producer(node):
            continue
        out_symbols = unbacked_symbols(example_value(node), known)
        in_symbols = input_unbacked_symbols(node, known)
        new_symbols = out_symbols - in_symbols
        for sym in new_symbols:
            origin_of.setdefault(sym, node)
        if NOT_PADDABLE in node.meta:  # a producer padding refused: padding.py's finding names why
            found[node] = [node.meta[NOT_PADDABLE]]
        elif new_symbols or has_tag(node, torch.Tag.dynamic_output_shape):
            names = ", ".join(sorted(str(s) for s in new_symbols)) or "its output"
            hint = _PADDABLE_HINT if node.meta.get(PADDABLE) else _ORIGIN_HINT
            found[node] = [finding(node, Reason.DYNAMIC_SHAPE, hint=hint,
                                   detail=f"output shape depends on tensor data ({names})")]
        elif out_symbols or in_symbols:
            sym = sorted(out_symbols | in_symbols, key=str)[0]
            origin = origin_of.get(sym)
            downstream = origin is not None  # fixing the origin fixes this op: no hint of its own
            source = f" from {origin.name}" if downstream else ""
            found[node] = [finding(node, Reason.DYNAMIC_SHAPE, hint=None if downstream else _ORIGIN_HINT,
                                   detail=f"works on a data-dependent size ({sym}{source})", downstream=downstream)]
    return found

"""Collectives traced by Dynamo (functional collectives). Fixed shapes are capturable (NCCL supports graph
capture); split sizes or shapes that depend on tensor data (expert-parallel all_to_all) are not."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .common import Finding, compute_nodes, example_value, finding

_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")
_HINT = ("pad every rank's tokens to a fixed capacity (drop-and-pad dispatch) so the split sizes are static, "
         "or leave the dispatch eager")


def is_collective(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.namespace in _NAMESPACES
    module = getattr(target, "__module__", "") or ""
    return node.op == "call_function" and module.startswith("torch.distributed")


def _depends_on_data(node: fx.Node) -> bool:
    values = [example_value(node)] + [a for a in node.args if not isinstance(a, fx.Node)]
    values += [example_value(a) for a in node.all_input_nodes]
    for value in values:
        try:
            if free_unbacked_symbols(value):
                return True
        except Exception:
            continue
    return False


def find_data_dependent_collectives(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    return {node: [finding(node, "collective", hint=_HINT,
                           detail="split sizes or shapes of this collective depend on tensor data")]
            for node in compute_nodes(gm) if is_collective(node) and _depends_on_data(node)}

"""Analyses over a Dynamo FX graph. Each pass is a pure function `graph module -> {node: [Finding]}`.

The partitioner combines them; nothing here mutates the graph or depends on the config.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch.fx as fx

from .collectives import find_data_dependent_collectives
from ..reasons import Finding
from .common import (compute_nodes, input_description, is_static_placeholder, node_location, node_module_path,
                     op_name)
from .custom_ops import find_cudagraph_unsafe_ops
from .dtensor import find_data_dependent_redistributions
from .dynamic_shapes import find_data_dependent_shapes
from .host_tensors import find_host_tensor_reads
from .mutation import find_input_mutations
from .regions import RegionInfo, module_regions
from .scalar_inputs import find_scalar_input_reads
from .sync_ops import find_host_syncs

__all__ = [
    "Finding", "RegionInfo", "analyze", "compute_nodes", "input_description", "is_static_placeholder", "module_regions",
    "node_location", "node_module_path", "op_name",
]

# Most specific first: when several passes flag one node, the plan reports the first one's category first.
PASSES: List[Callable[[fx.GraphModule], Dict[fx.Node, List[Finding]]]] = [
    find_data_dependent_collectives,
    find_data_dependent_redistributions,
    find_host_syncs,
    find_host_tensor_reads,
    find_cudagraph_unsafe_ops,
    find_input_mutations,
    find_data_dependent_shapes,
    find_scalar_input_reads,
]


def analyze(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    """Every blocking finding per node, most specific first; a node absent from the result is capture-safe."""
    results = [run_pass(gm) for run_pass in PASSES]
    merged: Dict[fx.Node, List[Finding]] = {}
    for node in compute_nodes(gm):  # graph order, so reports read top to bottom
        found = [f for result in results for f in result.get(node, ())]
        if found:
            merged[node] = found
    return merged

"""Python numbers that Dynamo passes into the graph as 0-d CPU tensors and reads back with `.item()` (with
dynamic=True, floats such as a LayerNorm eps). The read is a host operation, so it stays eager; the backend
moves these reads to the top of the graph (split.hoist_scalar_input_reads), so they do not cut captured
regions apart, and the number reaches the captured partitions as a plain argument: the runtime's graph bank
keys on it, one graph per value."""

from __future__ import annotations

from typing import Dict, List

import torch.fx as fx

from ..reasons import Finding, Reason
from .common import compute_nodes, finding, is_scalar_input_read


def find_scalar_input_reads(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    return {node: [finding(node, Reason.SCALAR_INPUT, detail="reads a Python number Dynamo passed in as a tensor; "
                                                        "captured partitions get its value as an argument")]
            for node in compute_nodes(gm) if is_scalar_input_read(node)}

"""Custom ops that declare themselves unsafe for CUDA graphs with `torch.Tag.cudagraph_unsafe`."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.fx as fx

from ..reasons import Finding, Reason
from .common import compute_nodes, finding


def _unsafe(target) -> bool:
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.cudagraph_unsafe in target.tags
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(torch.Tag.cudagraph_unsafe in getattr(target, o).tags for o in target.overloads())
    return False


def find_cudagraph_unsafe_ops(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    return {node: [finding(node, Reason.CUDAGRAPH_UNSAFE, detail="the op is tagged torch.Tag.cudagraph_unsafe",
                           hint="the op's author marked it unsafe to capture; it runs eagerly")]
            for node in compute_nodes(gm) if _unsafe(node.target)}

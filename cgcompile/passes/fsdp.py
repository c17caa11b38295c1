"""FSDP2 parameters that `fully_shard(reshard_after_forward=True)` frees after forward: a graph reading one would be
captured again every step, since FSDP2 gathers it again at a new address. Plan time; the runtime side (keeping
the unsharded storage when the user asks for it) is runtime/frame/fsdp.py."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch.fx as fx

from .. import _compat
from ..reasons import Finding, Reason


def fsdp_inputs(example_inputs: Sequence[Any]) -> Dict[int, _compat.FsdpParam]:
    """position -> FSDP2 parameter, for the inputs that are FSDP2 unsharded parameters ({} without FSDP2)."""
    params = {id(p.unsharded): p for p in _compat.fsdp2_params()}
    if not params:
        return {}
    found = {}
    for index, value in enumerate(example_inputs):
        param = params.get(id(value))
        if param is not None and param.unsharded is value:
            found[index] = param
    return found


def placeholders(gm: fx.GraphModule) -> List[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def resharded_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any], keep: bool) -> Dict[str, Finding]:
    """Plan time: placeholder name -> why no graph may read it, for the FSDP2 parameters that
    fully_shard(reshard_after_forward=True) frees after forward (none when `keep`, option fsdp_keep_unsharded)."""
    if keep:
        return {}
    found = fsdp_inputs(example_inputs)
    names = placeholders(gm)
    return {names[i].name: Finding(
        Reason.FSDP_RESHARDED_PARAMS, "-", None, None,
        hint="options={'fsdp_keep_unsharded': True} keeps them unsharded and captures (their unsharded bytes stay "
             "resident), or fully_shard(..., reshard_after_forward=False)",
        detail=f"reads FSDP2 parameter {p.fqn}: reshard_after_forward=True frees it after forward and gathers it "
               f"again at a new address, so a graph reading it would be captured again every step")
        for i, p in found.items() if p.resharded_after_forward}

"""DTensor redistributions in a Dynamo graph: where tensor-parallel code communicates, and with which collective.

Dynamo traces DTensor code (`parallelize_module`'s ParallelStyles, torchtitan-style models) at the DTensor level:
the graph holds `DTensor.from_local`, `Tensor.redistribute`, `Tensor.to_local` and ops on DTensor values, each with a
fake DTensor (its placements, its mesh) as example value. The collectives themselves appear only when aot_autograd
traces a partition: DTensor lowers each redistribution to a functional collective (`_c10d_functional.all_reduce`,
`all_gather_into_tensor`, `reduce_scatter_tensor`, `all_to_all_single`) and its `wait_tensor` in that partition's
forward graph, and the gradients' redistributions (the backward of `from_local` and `redistribute`) in the same
partition's backward graph. Which collectives the backward runs depends on the gradients' placements, which the
forward graph does not show; the plan lists the forward ones.

What a redistribution runs, per mesh dimension of more than one rank whose placement changes
(torch/distributed/tensor/_redistribute.py, checked 2.11, 2.13): Partial -> Replicate all_reduce, Partial -> Shard
reduce_scatter, Shard -> Replicate all_gather, Shard(i) -> Shard(j) all_to_all; Replicate -> Shard or Partial is
local (a slice or a scale).

Sizes: with only backed sizes a redistribution's collective has fixed sizes per graph-bank entry and is captured with
its partition. One whose shapes carry unbacked symbols (rows selected by data) is a `collective` finding: eager, as
any collective with data-dependent sizes (collectives.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch.fx as fx

from ..reasons import Finding, Reason
from .common import compute_nodes, example_value, node_location, node_module_path, op_key, op_name, unbacked_symbols

_REDISTRIBUTING_METHODS = frozenset({"redistribute", "full_tensor"})
_HINT = ("give the redistributed tensor a static shape (pad the selected rows to a fixed capacity, e.g. with "
         "torch.nonzero_static), or accept the redistribution running eagerly")


@dataclass(frozen=True)
class Redistribution:
    """One collective a DTensor redistribution node runs in the forward graph, on one mesh dimension."""

    collective: str  # all_reduce, all_gather, reduce_scatter, all_to_all
    mesh_dim: str  # the mesh dimension's name ("tp"), or "mesh dim 0" on a mesh without names
    source: str  # the placement before, e.g. "Partial(sum)"
    target: str  # the placement after, e.g. "Replicate()"
    location: Optional[str]
    module: Optional[str]

    def to_json(self) -> dict:
        return {"collective": self.collective, "mesh_dim": self.mesh_dim, "source": self.source,
                "target": self.target, "location": self.location, "module": self.module}


def _dtensor_type() -> Optional[type]:
    """DTensor, when torch.distributed.tensor was imported (no DTensor can exist otherwise): the common graph, with
    no DTensor at all, costs one dict lookup."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def _placement_name(placement: Any) -> str:
    """'Shard(1)', 'Replicate', 'Partial(sum)'."""
    return repr(placement).replace("dim=", "").replace("()", "")


def collective_between(source: Any, target: Any) -> Optional[str]:
    """The collective that turns one mesh dimension's placement `source` into `target`; None when no rank needs
    another's data (the same placement, or Replicate to Shard / Partial). Strided shards (FSDP2 x TP) go through
    Replicate, as DTensor does."""
    if source == target or source.is_replicate():
        return None
    if source.is_partial():
        if target.is_replicate():
            return "all_reduce"
        return "reduce_scatter" if target.is_shard() else "all_reduce"
    return "all_to_all" if source.is_shard() and target.is_shard() else "all_gather"


def _mesh_dim_size(value: Any, dim: int) -> int:
    try:
        return int(value.device_mesh.size(dim))
    except Exception:  # a mesh that cannot say: assume it spans ranks
        return 2


def _is_redistribution(node: fx.Node, dtensor: type) -> bool:
    """A `redistribute` or `full_tensor` of a DTensor: a method call (torch 2.13), or a function named for it
    (torch 2.11's Dynamo puts `x.redistribute(...)` in the graph as a function named "prim_redistribute")."""
    if node.op == "call_method":
        return node.target in _REDISTRIBUTING_METHODS
    return node.op == "call_function" and op_key(node) in _REDISTRIBUTING_METHODS and \
        isinstance(example_value(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None, dtensor)


def _mesh_dim_names(value: Any) -> Sequence[str]:
    names = getattr(getattr(value, "device_mesh", None), "mesh_dim_names", None)
    return names or [f"mesh dim {i}" for i in range(len(value.placements))]


def redistributions(gm: fx.GraphModule) -> Dict[fx.Node, List[Redistribution]]:
    """Per DTensor redistribution node (`redistribute`, `full_tensor`), the collectives it runs in the forward
    graph (nodes whose placements do not change, or change locally, are left out)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return {}
    found: Dict[fx.Node, List[Redistribution]] = {}
    for node in compute_nodes(gm):
        if not _is_redistribution(node, dtensor):
            continue
        source = example_value(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        if not isinstance(source, dtensor):
            continue
        result = example_value(node)
        targets = result.placements if isinstance(result, dtensor) else [None] * len(source.placements)
        names = _mesh_dim_names(source)
        collectives = []
        for dim, (name, before, after) in enumerate(zip(names, source.placements, targets)):
            after = after if after is not None else _replicate()
            collective = collective_between(before, after) if _mesh_dim_size(source, dim) > 1 else None
            if collective is not None:
                collectives.append(Redistribution(collective, str(name), _placement_name(before),
                                                  _placement_name(after), node_location(node), node_module_path(node)))
        if collectives:
            found[node] = collectives
    return found


def _replicate() -> Any:
    """`full_tensor()` returns a plain tensor: every mesh dimension ends Replicate."""
    from torch.distributed.tensor import Replicate
    return Replicate()


def find_data_dependent_redistributions(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    """DTensor redistributions whose collective's sizes depend on tensor data (unbacked symbols in their shapes):
    a graph would fix them at capture."""
    found: Dict[fx.Node, List[Finding]] = {}
    for node, collectives in redistributions(gm).items():
        symbols = unbacked_symbols(example_value(node)) | unbacked_symbols(example_value(node.args[0]))
        if symbols:
            names = ", ".join(sorted(str(s) for s in symbols))
            what = ", ".join(f"{c.collective} over {c.mesh_dim}" for c in collectives)
            found[node] = [Finding(Reason.COLLECTIVE, op_name(node), node_location(node), node_module_path(node), _HINT,
                                   f"DTensor redistribution ({what}) of a tensor whose shape depends on tensor data "
                                   f"({names})")]
    return found

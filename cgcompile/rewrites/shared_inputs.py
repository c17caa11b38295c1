"""A value several captured partitions of a frame read, copied into graph memory once per call.

A captured graph reads a tensor that is neither a parameter nor another graph's output from a static buffer of its
own, filled by a copy before each replay. A value that N partitions of one frame read, such as a decode step's
position and attention mask in layer scope, or the rotary cos/sin and mask a model makes outside its tagged
attention modules, is so copied N times per call (copy launches outside any graph) and held in N buffers. When
that value comes from outside every graph (a frame input, or an eager partition's result), the first captured
partition reading it now also returns a clone of it made inside its graph, and the later ones read that clone where
it lies: another graph's output, read in place (BORROWED in runtime/local/instance.py), as a layer reads the
previous layer's output. One copy in and one kernel inside the first graph per call, instead of N copy launches.
In training the clone needs no gradient, and a later graph's forward that saves it for its backward holds the first
graph's memory until then, as its saved activations already do.

Left as they are: parameters and buffers (read in place already), values no captured partition after the first
reads, non-tensors and tensor subclasses, tensors on another device than the frame's, values that require grad,
and any value that an op of the frame writes in place, directly or through a view (the clone would not see the
write).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..passes.common import COMPUTE_OPS, compute_nodes, example_value, is_static_placeholder, view_root, written_args
from ..plan import GraphPlan

__all__ = ["share_inputs"]


def share_inputs(gm: fx.GraphModule, graph_plan: GraphPlan) -> GraphPlan:
    """Rewrite gm (before it is split by `graph_plan`) so each shared value is copied once, as above; returns the
    plan with each clone in the partition that makes it (its op count unchanged: the clone is how values travel)."""
    owner = graph_plan.node_to_partition
    captured = {p.id for p in graph_plan.partitions if p.captured}
    written = {view_root(w) for node in compute_nodes(gm) for w in written_args(node)}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    added: Dict[int, List[str]] = {}
    for value in list(gm.graph.nodes):
        if owner.get(value.name) in captured and value.op != "placeholder" \
                or not _copied_in(value, written, graph_plan.device):
            continue
        readers: Dict[int, List[fx.Node]] = {}
        for user in value.users:
            if owner.get(user.name) in captured:
                readers.setdefault(owner[user.name], []).append(user)
        if len(readers) < 2:
            continue
        first = min(readers, key=lambda p: min(order[u] for u in readers[p]))
        earliest = min(readers[first], key=order.__getitem__)
        with gm.graph.inserting_before(earliest):
            clone = gm.graph.call_function(torch.clone, (value,))
        clone.meta = {key: earliest.meta[key] for key in ("stack_trace", "nn_module_stack", "source_fn_stack")
                      if key in earliest.meta}
        clone.meta["example_value"] = example_value(value).clone()
        for partition, users in readers.items():
            if partition != first:
                for user in users:
                    user.replace_input_with(value, clone)
        added.setdefault(first, []).append(clone.name)
    if not added:
        return graph_plan
    gm.recompile()
    partitions = [dataclasses.replace(p, nodes=_with_clones(gm, p.nodes, added[p.id])) if p.id in added else p
                  for p in graph_plan.partitions]
    return dataclasses.replace(graph_plan, partitions=partitions)


def _copied_in(value: fx.Node, written: set, device: str) -> bool:
    """Would a captured graph reading `value` copy it into a buffer of its own, and may a clone stand in for it?
    (On the frame's device only: a clone of a CPU tensor in a CUDA graph would be a host op in the capture.)"""
    if is_static_placeholder(value) or value.op != "placeholder" and value.op not in COMPUTE_OPS:
        return False
    found = example_value(value)
    return isinstance(found, torch.Tensor) and found.device.type == device \
        and not is_traceable_wrapper_subclass(found) and not found.requires_grad and view_root(value) not in written


def _with_clones(gm: fx.GraphModule, names: tuple, clones: List[str]) -> tuple:
    """The partition's node names with its clones, in graph order."""
    members = set(names) | set(clones)
    return tuple(node.name for node in gm.graph.nodes if node.name in members)

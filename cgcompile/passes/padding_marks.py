"""The marks `dynamic_padding` (padding.py) leaves on a graph for the passes and the planner to read: the node
meta keys it writes, and how to recognise its bucketed producer and the nodes that belong to it. One module,
owned by the padding feature, so writer and readers spell the protocol one way."""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from .common import compute_nodes, example_value, unbacked_symbols

__all__ = ["BUCKETED_OP_NAME", "NOT_PADDABLE", "PADDABLE", "PADDED", "bucketed_read", "bucketed_symbols",
           "is_bucketed_producer"]

# Node meta keys, written by padding.py, read by the passes (dynamic_shapes, sync_ops) and the planner.
NOT_PADDABLE = "cgcompile_not_paddable"  # a data-dependent producer left eager: the not_paddable Finding
PADDABLE = "cgcompile_paddable"  # dynamic_padding="off": this producer could be padded exactly
PADDED = "cgcompile_padding"  # a node made or changed by a padding rewrite: its padding.Padding

# dynamic_padding="buckets": the custom op (registered by padding.py) that reads row counts on the host once
BUCKETED_OP_NAME = "cgcompile::nonzero_bucketed"


def is_bucketed_producer(node: fx.Node) -> bool:
    """dynamic_padding="buckets": the op that reads a row count on the host and pads it to a bucket."""
    return getattr(node.target, "name", lambda: "")() == BUCKETED_OP_NAME


def bucketed_read(node: fx.Node) -> Optional[fx.Node]:
    """The bucketed producer call that `node` is part of: the call itself, one of its results (getitem), or
    the read of their common row count (sym_size), which binds the size symbol. They stay together, eager."""
    if node.op == "call_function" and node.target is torch.ops.aten.sym_size.int:
        node = node.args[0]
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
        node = node.args[0]
    return node if is_bucketed_producer(node) else None


def bucketed_symbols(gm: fx.GraphModule) -> set:
    """Row counts of bucketed producers: known once their (eager) producer ran, so the partitions after it are
    captured once per bucket, like backed sizes."""
    symbols: set = set()
    for node in compute_nodes(gm):
        if is_bucketed_producer(node):
            symbols |= unbacked_symbols(example_value(node))
    return symbols

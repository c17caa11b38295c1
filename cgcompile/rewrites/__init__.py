"""FX rewrites made before planning, each on a copy the backend owns (the passes in passes/ only read): scalar
reads hoisted to the top, data-dependent index ops made static (dynamic_padding), checkpoints inlined around
eager islands. One rewrites aot's aten graphs instead, for the eager inner compiler at run time: a graph input's
functional write done in place again (input_writes.py)."""

from __future__ import annotations

import copy

import torch.fx as fx

__all__ = ["copy_graph_module"]


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` that a rewrite may change without touching `gm`: new nodes, each with its own meta dict (the
    values in it shared), the same submodules and attributes."""
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    copied.meta = dict(gm.meta)
    return copied

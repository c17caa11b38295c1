"""Activation checkpoints in graph code that runs eagerly: run them as the user's eager code would.

Dynamo turns `torch.utils.checkpoint.checkpoint(fn, ...)` (reentrant or not) into the higher-order op
`tag_activation_checkpoint`. Inside aot_autograd that op only marks its body's ops for recomputation. Run as
eager code (an eager partition, a frame with nothing captured, torch's own backend="eager"), torch 2.13 calls
`checkpoint(..., preserve_rng_state=False)` on its body (torch/_higher_order_ops/wrap.py), so a random op in the
body (dropout) draws a new mask when backward recomputes it: the gradients belong to another mask than the
forward's, silently (torch 2.11 does so only with a `context_fn`, and otherwise runs the body unchecked, saving
every activation). aot_autograd's own path keeps the mask.

Here each such node of a graph that runs eagerly calls `checkpoint_as_written` instead:
`torch.utils.checkpoint.checkpoint` with the options the user gave (Dynamo keeps them on the node),
`preserve_rng_state` True unless the user turned it off, non-reentrant as under torch.compile, and the body's
`context_fn` when it has one (selective checkpointing). A body holding checkpoints of its own is copied first and
the copy's rewritten the same way: the original body may also sit in a captured partition, where aot_autograd
must still see the op.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch.fx as fx
import torch.utils.checkpoint

from ..passes.checkpoints import checkpoint_body
from . import copy_graph_module

__all__ = ["checkpoint_as_written", "run_checkpoints_eagerly"]


def checkpoint_as_written(body: fx.GraphModule, *args: Any, **options: Any) -> Any:
    """What the checkpoint call in the user's code does in eager mode, with `body` as its function."""
    options = dict(options, use_reentrant=False)
    options.setdefault("preserve_rng_state", True)
    context_fn = getattr(body, "meta", {}).get("_checkpoint_context_fn")
    if context_fn is not None:
        options["context_fn"] = context_fn
    return torch.utils.checkpoint.checkpoint(body, *args, **options)


def run_checkpoints_eagerly(gm: fx.GraphModule) -> bool:
    """Rewrite, in place, every checkpoint node of `gm` (which is to run eagerly) to call checkpoint_as_written
    on its body (a rewritten copy where the body holds checkpoints itself); True if it changed gm (the caller
    recompiles it)."""
    changed = False
    for node in list(gm.graph.nodes):
        body = checkpoint_body(node)
        if body is None:
            continue
        if any(checkpoint_body(inner) is not None for inner in body.graph.nodes):
            nested = copy_graph_module(body)
            run_checkpoints_eagerly(nested)
            nested.recompile()
            fetch = node.args[0]
            name = next(n for n in (f"eager_{fetch.target}_{i}" for i in itertools.count()) if not hasattr(gm, n))
            gm.add_submodule(name, nested)
            with gm.graph.inserting_before(node):
                node.args = (gm.graph.get_attr(name),) + tuple(node.args[1:])
            if not fetch.users:
                gm.graph.erase_node(fetch)
        node.target = checkpoint_as_written
        changed = True
    return changed

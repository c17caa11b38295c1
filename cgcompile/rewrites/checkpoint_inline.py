"""Activation checkpoints that hold an eager island: inline their bodies, tagged for recomputation.

Dynamo traces a non-reentrant `torch.utils.checkpoint.checkpoint(fn, ...)` (what Hugging Face's
`gradient_checkpointing_enable(...)` and torchtitan's activation checkpointing call) as one higher-order op,
`tag_activation_checkpoint`, whose body is a graph module: to the planner one opaque node. aot_autograd later
inlines that body and tags each of its ops for recomputation, so the backward recomputes them instead of saving
their activations. When the body holds an op that must run eagerly (a host sync such as transformers' fp32
grouped-mm fallback, a data-dependent shape), the opaque node would make the whole region fail at capture.

The same holds for a body that holds a module the config selects (`cuda_graph_modules=["attn", "mlp"]` with a
checkpointed decoder layer, or `checkpoint(mlp, x)`): as one node it carries no tag, so nothing in it would be
captured.

So such a body is inlined here, before planning, each inlined node tagged as aot_autograd tags a checkpointed op
(`recompute` = PREFER_RECOMPUTE, one `ac_graph_id` per region; torch copies both onto the aten ops it traces
from a node): the planner cuts around the island, or at the tagged modules, as anywhere else, and
aot_autograd's partitioner still recomputes the captured parts in backward. What is left eager (the island, the
glue between tagged modules) saves its inputs as eager code does. Other bodies stay one node (captured whole,
recomputed by aot_autograd; run eagerly by checkpoint_eager.py); a checkpoint with a `context_fn` (selective
checkpointing, its own policy over the aten ops aot traces from the whole body) is left as it is: the planner
captures it whole when every module it holds is selected.
"""

from __future__ import annotations

import itertools
import operator
from typing import AbstractSet, Dict, List

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..passes import analyze
from ..passes.checkpoints import checkpoint_body, tags_inside

__all__ = ["inline_checkpoints"]

# aot_autograd numbers the regions it traces from 0 (torch/_higher_order_ops/wrap.py); ours stay clear of them
_REGION_IDS = itertools.count(1 << 30)


def inline_checkpoints(gm: fx.GraphModule, selected: AbstractSet[str] = frozenset()) -> List[str]:
    """Inline, in place, every activation checkpoint whose body holds a node the planner keeps eager or a module
    tagged with one of the `selected` tags; returns the names of the checkpoint nodes inlined."""
    inlined = []
    for node in list(gm.graph.nodes):
        body = checkpoint_body(node)
        if body is None or "_checkpoint_context_fn" in getattr(body, "meta", {}) \
                or not (analyze(body) or set(tags_inside(node)) & selected):
            continue
        _inline(gm, node, body)
        inlined.append(node.name)
    if inlined:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return inlined


def _inline(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule) -> None:
    region = next(_REGION_IDS)
    env: Dict[fx.Node, fx.Node] = dict(zip((n for n in body.graph.nodes if n.op == "placeholder"), node.args[1:]))
    result = None
    with gm.graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                result = inner.args[0]
                continue
            if inner.op == "get_attr":  # a constant or nested body of the checkpoint: give it a name in gm
                name = _free_name(gm, inner.target)
                setattr(gm, name, operator.attrgetter(inner.target)(body))
                copied = gm.graph.get_attr(name)
                copied.meta = dict(inner.meta)
            else:
                copied = gm.graph.node_copy(inner, lambda n: env[n])
                copied.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                copied.meta["ac_graph_id"] = region
            env[inner] = copied
    outputs = fx.map_arg(result, lambda n: env[n])
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
    if node.users:  # the whole tuple is used: stand in with a tuple of the outputs
        with gm.graph.inserting_before(node):
            node.replace_all_uses_with(gm.graph.call_function(tuple, (list(outputs),)))
    gm.graph.erase_node(node)


def _free_name(gm: fx.GraphModule, target: str) -> str:
    base = "checkpoint_" + target.replace(".", "_")
    for index in itertools.count():
        name = f"{base}_{index}"
        if not hasattr(gm, name):
            return name
    raise AssertionError("unreachable")

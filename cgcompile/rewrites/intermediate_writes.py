"""An intermediate's in-place write done in place again, in the aten graphs the eager inner compiler runs.

aot_autograd hands the inner compiler functional graphs: a model's in-place write to a tensor it made itself
(transformers' MoE `inv_perm[perm] = arange(...)`, a gather's gradient written into zeros, a residual `add_`)
arrives as the out-of-place op, which on any device first copies its whole input (`index_put` is a `copy_` and an
`index_put_`), then writes. Eager ran one kernel where the graph runs two, and each copy allocates another buffer
of the input's size inside the graph's pool. Inductor reinplaces such ops itself; the eager inner compiler runs
the graph it is given. torch.fx's `reinplace` pass (backward compatible, meant for functional aten graphs like
these) puts the write back in place wherever the input is not read afterwards, is no graph input (a graph input's
write: input_writes.py) and is no graph output (a saved activation, a user output).

Kept only when every op it rewrote keeps its value's layout (the value's readers now read the written tensor):
`reinplace` checks size and dtype, not strides, and a later op (a `view`) may need the stride the out-of-place op
gave (`y[::2] + 1` written into the strided slice). Otherwise, and where the pass itself fails (torch 2.13's fails on
a graph holding `_assert_async`, which `one_hot` leaves in MoE routers), the graph stays as aot wrote it.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.fx as fx
from torch.fx.passes.reinplace import reinplace

from ..passes.common import same_traced_layout

__all__ = ["write_intermediates_in_place"]

log = logging.getLogger("cgcompile")


def write_intermediates_in_place(gm: fx.GraphModule) -> int:
    """Rewrite gm's functional writes to its own intermediates in place (module docstring); how many ops now
    write in place. Needs each placeholder's traced value (`meta["val"]`, as aot leaves them); mutates gm."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if not all(isinstance(p.meta.get("val"), (torch.Tensor, int, float, bool, torch.SymInt, type(None)))
               for p in placeholders):
        return 0
    before = {node: node.target for node in gm.graph.nodes if node.op == "call_function"}
    saved = copy.deepcopy(gm.graph)
    try:
        reinplace(gm, *[p.meta.get("val") for p in placeholders])
    except Exception as exc:  # e.g. torch 2.13's pass on a graph holding `_assert_async` (one_hot's checks)
        log.debug("cgcompile: intermediate writes left as aot wrote them: reinplace failed: %s: %s",
                  type(exc).__name__, exc)
        rewritten = None
    else:
        rewritten = [node for node in gm.graph.nodes if node in before and node.target is not before[node]]
    # the in-place op's readers now read the tensor it writes: its layout must be the one they were traced with
    if rewritten is None or not all(isinstance(n.args[0], fx.Node) and same_traced_layout(n, n.args[0])
                                    for n in rewritten):
        gm.graph = saved
        gm.recompile()
        return 0
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return len(rewritten)

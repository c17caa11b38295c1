"""Run an aot_autograd graph with the strides it was traced with.

aot traces each graph on fake tensors and writes it for the strides their meta kernels give: a `reshape` in the
model becomes a plain `view` where the fake value is viewable, and an output aliasing an intermediate is
regenerated from those strides. Some meta kernels disagree with the real ones: torch 2.13's
`aten.softplus_backward` meta is contiguous, while the CPU/CUDA kernel follows the gradient's layout; a
transposed gradient then reaches a `view` that the real tensor cannot take ("view size is not compatible with
input tensor's size and stride", Qwen3-Next's gated delta-net in backward; `backend="aot_eager"` fails the same
way on the plain pattern; pytorch/pytorch#120035 is that family). Inductor plans its own layouts, so only graphs
run as aten code need this.

The fix holds every value to its traced layout: the first run of a graph goes node by node, compares each
tensor's real strides with the traced ones, copies a value that differs into its traced layout, and then
rewrites the graph to do the same copy at those nodes on every later run (eager or captured). Layouts are a
function of the input layouts, which one aot compilation fixes (the graph bank keys the partition's inputs by
stride, aot coerces tangents to their traced strides), so the nodes found in the first run are the nodes of
every run. A traced layout that overlaps itself (an expanded tangent) cannot hold an arbitrary value and is left
alone, as are symbolic layouts.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.fx as fx

from ...passes.common import written_args
from ..tensors import overlaps_itself

__all__ = ["keep_traced_strides", "restride", "traced_layout_differs"]

log = logging.getLogger("cgcompile")


def restride(value: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """`value` copied into a new tensor of the traced size and strides (called from rewritten graphs)."""
    out = torch.empty_strided(size, stride, dtype=value.dtype, device=value.device)
    out.copy_(value)
    return out


def traced_layout_differs(value: Any, traced: Any) -> Optional[tuple]:
    """(size, stride) to restride `value` to when its layout differs from the traced fake `traced`, else None.
    Strides of size-1 dimensions do not matter (no view or index reads them)."""
    if not isinstance(value, torch.Tensor) or not isinstance(traced, torch.Tensor) or value.layout != torch.strided:
        return None
    size, stride = tuple(traced.shape), tuple(traced.stride())
    if not all(isinstance(n, int) for n in size + stride) or tuple(value.shape) != size:
        return None  # symbolic (this compilation serves many sizes) or not what was traced: not ours to judge
    if all(a == b for a, b, n in zip(value.stride(), stride, size) if n > 1) or overlaps_itself(traced):
        return None
    return size, stride


class _StrideChecker(fx.Interpreter):
    """One run of the graph that restrides every value whose real layout differs from the traced one, and
    notes which nodes they were."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.found: List[tuple] = []  # (node, size, stride)

    def run_node(self, node: fx.Node) -> Any:
        value = super().run_node(node)
        layout = traced_layout_differs(value, node.meta.get("val"))
        if layout is None:
            return value
        self.found.append((node, *layout))
        return restride(value, *layout)


def _rewrite(gm: fx.GraphModule, found: Sequence[tuple]) -> None:
    """Insert `restride` after each node found. Every later op reads and writes the copy, as in the checking run,
    except that an in-place write to a graph input still goes to the input (the caller sees it)."""
    graph = gm.graph
    for node, size, stride in found:
        anchor = node
        if node.op == "placeholder":  # placeholders stay together at the top
            anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(anchor):
            copy = graph.call_function(restride, (node, list(size), list(stride)))
        copy.meta = dict(node.meta)
        node.replace_all_uses_with(copy, delete_user_cb=lambda user, node=node, copy=copy: (
            user is not copy and (node.op != "placeholder" or node not in written_args(user))))
    graph.lint()
    gm.recompile()


def keep_traced_strides(gm: fx.GraphModule, run: Callable[[list], Any], name: str = "") -> Callable[[list], Any]:
    """`run` (which executes `gm`) with every value held to its traced layout: the first call checks as it
    runs and rewrites `gm` where real and traced layouts differ; later calls run the rewritten `gm`."""
    state = {"checked": False}

    def run_checked(args: list) -> Any:
        if state["checked"]:
            return run(args)
        checker = _StrideChecker(gm)
        out = checker.run(*args)
        state["checked"] = True
        if checker.found:
            _rewrite(gm, checker.found)
            log.debug("cgcompile: %s: %d value(s) restrided to their traced layout (a meta kernel's strides differ "
                      "from the real kernel's): %s", name or "graph", len(checker.found),
                      ", ".join(str(node) for node, *_ in checker.found))
        return out

    return run_checked

"""The batch rows of a frame (option `capture_sizes`), at plan time: which symbol is the batch, whether padding
it is exact, and where it sits at the frame's boundary (runtime/frame/capture_sizes.py's BatchPadding reads that from
the plan: which inputs to pad along which dims, which outputs to slice back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import sympy
import torch
import torch.fx as fx

from ..reasons import Finding, Reason
from .common import example_value, is_static_placeholder, node_location, node_module_path, sym_expr
from .row_flow import exact_dims, row_flow

__all__ = ["BatchBoundary", "batch_boundary", "batch_padding_blocker", "batch_symbol"]


@dataclass(frozen=True)
class BatchBoundary:
    """Where the batch symbol sits at a frame's boundary, as plain data: per padded tensor input its position
    and batch dims, the integer inputs that are the batch itself, per output its batch dims, and the integer
    outputs that are the batch."""

    symbol: str
    pad_inputs: Tuple[Tuple[int, Tuple[int, ...]], ...]
    size_inputs: Tuple[int, ...]
    out_dims: Tuple[Tuple[int, ...], ...]
    size_outputs: Tuple[int, ...]

    def to_json(self) -> dict:
        return {"symbol": self.symbol, "pad_inputs": [[i, list(d)] for i, d in self.pad_inputs],
                "size_inputs": list(self.size_inputs), "out_dims": [list(d) for d in self.out_dims],
                "size_outputs": list(self.size_outputs)}


def batch_symbol(gm: fx.GraphModule) -> Optional[sympy.Symbol]:
    """The batch size symbol: dim 0 of the first user tensor input (not a parameter or buffer) whose size there
    is a plain symbol; None when the frame has a static batch."""
    for node in gm.graph.nodes:
        if node.op != "placeholder" or is_static_placeholder(node):
            continue
        value = example_value(node)
        if isinstance(value, torch.Tensor) and value.dim() and isinstance(sym_expr(value.shape[0]), sympy.Symbol):
            return sym_expr(value.shape[0])
    return None


def first_batch(gm: fx.GraphModule) -> Optional[int]:
    """Dim 0 of the first user tensor input with dims when it is a plain number (a static batch), else None."""
    for node in gm.graph.nodes:
        if node.op != "placeholder" or is_static_placeholder(node):
            continue
        value = example_value(node)
        if isinstance(value, torch.Tensor) and value.dim():
            size = value.shape[0]
            return size if isinstance(size, int) else None
    return None


def _plain_dims(value: Any, sym: Any) -> Optional[Tuple[int, ...]]:
    """Dims of a tensor (or the int itself: ()) whose size is exactly sym; None when sym is tangled in another."""
    if isinstance(value, torch.SymInt):
        expr = sym_expr(value)
        return () if expr == sym or sym not in expr.free_symbols else None
    dims, tangled = exact_dims(value, sym)
    return None if tangled else dims


def _boundary(gm: fx.GraphModule) -> Tuple[List[fx.Node], List[Any]]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = output.args[0]
    return placeholders, list(results) if isinstance(results, (tuple, list)) else [results]


def batch_padding_blocker(gm: fx.GraphModule, sym: Any) -> Optional[Finding]:
    """Why padding the `sym` rows of this frame would not be exact, or None when it is. A refused input is
    located at the line that reads it, a refused output at the line of the op producing it.

    The row analysis is passes/row_flow.py (allow_sinks=False: padded rows must reach the outputs untouched),
    run over the graph without its output node, since the outputs carrying the rows are sliced back here.
    """
    placeholders, results = _boundary(gm)
    for node in placeholders:
        if _plain_dims(example_value(node), sym) is None:
            read = next((n for n in node.users if node_location(n)), node)
            return Finding(Reason.NOT_PADDABLE, "input", node_location(read), node_module_path(read),
                           hint="keep the batch as its own dimension",
                           detail=f"input {node.name} has a dimension mixing the batch {sym} with another size")
    for result in results:
        if isinstance(result, fx.Node) and _plain_dims(example_value(result), sym) is None:
            return Finding(Reason.NOT_PADDABLE, "output", node_location(result), node_module_path(result),
                           hint="return the batch as its own dimension",
                           detail=f"output {result.name} has a dimension mixing the batch {sym} with another size")
    graph = fx.Graph()
    graph.graph_copy(gm.graph, {})
    graph.output(())
    return row_flow(fx.GraphModule(gm, graph), sym, allow_sinks=False).blocker


def batch_boundary(gm: fx.GraphModule, sym: Any) -> BatchBoundary:
    """The BatchBoundary of `sym` in gm (only meaningful when batch_padding_blocker found nothing)."""
    placeholders, results = _boundary(gm)
    values = [example_value(n) for n in placeholders]
    outs = [example_value(r) if isinstance(r, fx.Node) else None for r in results]
    return BatchBoundary(
        str(sym),
        tuple((i, _plain_dims(v, sym)) for i, v in enumerate(values)
              if isinstance(v, torch.Tensor) and _plain_dims(v, sym)),
        tuple(i for i, v in enumerate(values) if isinstance(v, torch.SymInt) and sym_expr(v) == sym),
        tuple(_plain_dims(v, sym) if isinstance(r, fx.Node) else () for r, v in zip(results, outs)),
        tuple(i for i, (r, v) in enumerate(zip(results, outs))
              if isinstance(r, fx.Node) and isinstance(v, torch.SymInt) and sym_expr(v) == sym))

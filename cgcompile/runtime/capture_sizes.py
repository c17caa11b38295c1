"""Batch-size buckets (option `capture_sizes`): pad the batch to the next captured size, slice the outputs back.

A server whose batch changes every step would otherwise record one graph per batch size (vLLM pads to a few
capture sizes for the same reason). The backend sees the frame after Dynamo: with a dynamic batch dimension
(automatic dynamic after the first size change, `dynamic=True`, or `torch._dynamo.mark_dynamic`) the frame's
user inputs carry a backed size symbol on dim 0 (s0). Per call, `BatchBuckets`:

- pads every tensor input whose dims are exactly that symbol with zero rows (token id 0, position 0: in range)
  up to the next listed size, and passes the padded size for the symbol's own integer input;
- runs the compiled frame, whose partitions then keep one graph per listed size in their graph bank;
- slices every output dim sized by the symbol back to the real batch (integer outputs equal to it too).

Exact only when rows stay independent: `batch_padding_blocker` refuses a frame where any op mixes the rows
(a softmax, norm or sum across the batch, the batch read as a number, a reshape merging it into another dim)
or a symbol-sized dim is not a plain one; writes of padded rows into buffers land in rows past the real batch
(e.g. `cache[:batch]`), which no real row reads. A batch larger than the largest size runs the frame's graph
eagerly, counted in `stats()["capture_size_overflows"]` and logged once per frame.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple

import sympy
import torch
import torch.fx as fx

from ..counters import add as _count
from ..passes.common import Finding, example_value, is_static_placeholder
from ..passes.row_flow import row_flow

__all__ = ["BatchBuckets", "batch_padding_blocker", "batch_symbol"]

log = logging.getLogger("cgcompile")


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def batch_symbol(gm: fx.GraphModule) -> Optional[sympy.Symbol]:
    """The batch size symbol: dim 0 of the first user tensor input (not a parameter or buffer) whose size there
    is a plain symbol; None when the frame has a static batch."""
    for node in gm.graph.nodes:
        if node.op != "placeholder" or is_static_placeholder(node):
            continue
        value = example_value(node)
        if isinstance(value, torch.Tensor) and value.dim() and isinstance(_expr(value.shape[0]), sympy.Symbol):
            return _expr(value.shape[0])
    return None


def _plain_dims(value: Any, sym: Any) -> Optional[Tuple[int, ...]]:
    """Dims of a tensor (or the int itself: ()) whose size is exactly sym; None when sym is tangled in another."""
    if isinstance(value, torch.SymInt):
        expr = _expr(value)
        return () if expr == sym or sym not in expr.free_symbols else None
    if not isinstance(value, torch.Tensor):
        return ()
    dims = []
    for i, size in enumerate(value.shape):
        expr = _expr(size)
        if expr == sym:
            dims.append(i)
        elif sym in expr.free_symbols:
            return None
    return tuple(dims)


def _boundary(gm: fx.GraphModule) -> Tuple[List[fx.Node], List[Any]]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = output.args[0]
    return placeholders, list(results) if isinstance(results, (tuple, list)) else [results]


def batch_padding_blocker(gm: fx.GraphModule, sym: Any) -> Optional[Finding]:
    """Why padding the `sym` rows of this frame would not be exact, or None when it is.

    The row analysis is passes/row_flow.py (allow_sinks=False: padded rows must reach the outputs untouched),
    run over the graph without its output node, since the outputs carrying the rows are sliced back here.
    """
    placeholders, results = _boundary(gm)
    for node in placeholders:
        if _plain_dims(example_value(node), sym) is None:
            return Finding("not_paddable", "input", None, None, hint="keep the batch as its own dimension",
                           detail=f"input {node.name} has a dimension mixing the batch {sym} with another size")
    for result in results:
        if isinstance(result, fx.Node) and _plain_dims(example_value(result), sym) is None:
            return Finding("not_paddable", "output", None, None, hint="return the batch as its own dimension",
                           detail=f"output {result.name} has a dimension mixing the batch {sym} with another size")
    graph = fx.Graph()
    graph.graph_copy(gm.graph, {})
    graph.output(())
    return row_flow(fx.GraphModule(gm, graph), sym, allow_sinks=False).blocker


class BatchBuckets:
    """Wraps a compiled frame: pad the batch to the next capture size, run, slice back (see module docstring)."""

    def __init__(self, gm: fx.GraphModule, sym: Any, run: Callable[..., Any], sizes: Sequence[int], name: str):
        placeholders, results = _boundary(gm)
        self.sym, self.run, self.eager, self.name = sym, run, gm.forward, name
        self.sizes = sorted(sizes)
        self.pad_inputs = [(i, _plain_dims(example_value(n), sym)) for i, n in enumerate(placeholders)
                           if isinstance(example_value(n), torch.Tensor) and _plain_dims(example_value(n), sym)]
        self.size_inputs = [i for i, n in enumerate(placeholders) if isinstance(example_value(n), torch.SymInt)
                            and _expr(example_value(n)) == sym]
        self.out_dims = [_plain_dims(example_value(r), sym) if isinstance(r, fx.Node) else () for r in results]
        self.size_outputs = {i for i, r in enumerate(results) if isinstance(r, fx.Node)
                             and isinstance(example_value(r), torch.SymInt) and _expr(example_value(r)) == sym}
        self._overflow_logged = False
        self.runtime = getattr(run, "runtime", None)

    def batch_of(self, args: Sequence[Any]) -> int:
        if self.pad_inputs:
            index, dims = self.pad_inputs[0]
            return args[index].shape[dims[0]]
        return int(args[self.size_inputs[0]])

    def __call__(self, *args: Any) -> Any:
        batch = self.batch_of(args)
        slot = bisect.bisect_left(self.sizes, batch)
        if slot == len(self.sizes):
            _count("capture_size_overflows")
            if not self._overflow_logged:
                self._overflow_logged = True
                log.warning("cgcompile: %s: batch %d is larger than the largest capture size %d; such calls run "
                            "eagerly (counted in stats()['capture_size_overflows'])", self.name, batch, self.sizes[-1])
            return self.eager(*args)
        target = self.sizes[slot]
        padded = list(args)
        if target == batch:  # contiguous like a padded input: one graph-bank entry per size, whatever the layout
            for index, _ in self.pad_inputs:
                padded[index] = args[index].contiguous()
            return self.run(*padded)
        for index, dims in self.pad_inputs:
            padded[index] = _pad(args[index], dims, batch, target)
        for index in self.size_inputs:
            padded[index] = target
        versions = {index: padded[index]._version for index, _ in self.pad_inputs}
        outputs = self.run(*padded)
        with torch.no_grad():  # an input the frame wrote (a KV cache sized by the batch): its real rows go back
            for index, dims in self.pad_inputs:
                if padded[index]._version != versions[index]:
                    args[index].copy_(_real_rows(padded[index], dims, batch))
        return self._slice(outputs, batch)

    def _slice(self, outputs: Any, batch: int) -> Any:
        single = not isinstance(outputs, (tuple, list))
        items = [outputs] if single else list(outputs)
        for i, dims in enumerate(self.out_dims):
            value = items[i]
            if i in self.size_outputs:
                items[i] = batch
            elif isinstance(value, torch.Tensor):
                for dim in dims:
                    value = value.narrow(dim, 0, batch)
                items[i] = value
        if single:
            return items[0]
        return type(outputs)(items) if type(outputs) in (list, tuple) else type(outputs)(*items)


def _real_rows(t: torch.Tensor, dims: Sequence[int], batch: int) -> torch.Tensor:
    for dim in dims:
        t = t.narrow(dim, 0, batch)
    return t


def _pad(t: torch.Tensor, dims: Sequence[int], batch: int, target: int) -> torch.Tensor:
    """t with every dim in `dims` grown from batch to target rows, the new rows zero."""
    shape = list(t.shape)
    for dim in dims:
        shape[dim] = target
    out = t.new_zeros(shape)
    view = out
    for dim in dims:
        view = view.narrow(dim, 0, batch)
    view.copy_(t)
    return out

"""Batch padding (option `capture_sizes`): pad the batch to the next captured size, slice the outputs back.

A server whose batch changes every step would otherwise record one graph per batch size (vLLM pads to a few
capture sizes for the same reason). The backend sees the frame after Dynamo: with a dynamic batch dimension
(automatic dynamic after the first size change, `dynamic=True`, or `torch._dynamo.mark_dynamic`) the frame's
user inputs carry a backed size symbol on dim 0 (s0). Per call, `BatchPadding`:

- pads every tensor input whose dims are exactly that symbol with zero rows (token id 0, position 0: in range)
  up to the next listed size, and passes the padded size for the symbol's own integer input (which inputs and
  dims: the plan's BatchBoundary, found at plan time by passes/batch_rows.py);
- runs the compiled frame, whose partitions then keep one graph per listed size in their graph bank;
- slices every output dim sized by the symbol back to the real batch (integer outputs equal to it too).

Exact only when rows stay independent: `batch_padding_blocker` (passes/batch_rows.py) refuses a frame where any op mixes the rows
(a softmax, norm or sum across the batch, the batch read as a number, a reshape merging it into another dim)
or a symbol-sized dim is not a plain one; writes of padded rows into buffers land in rows past the real batch
(e.g. `cache[:batch]`), which no real row reads. A batch larger than the largest size runs the frame's graph
eagerly, counted in `stats()["capture_size_overflows"]` and logged once per frame.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Sequence

import torch

from ...counters import add as count
from ...passes.batch_rows import BatchBoundary

__all__ = ["BatchPadding"]

log = logging.getLogger("cgcompile")


class BatchPadding:
    """Wraps a compiled frame: pad the batch to the next capture size, run, slice back (see module docstring)."""

    def __init__(self, boundary: BatchBoundary, run: Callable[..., Any], eager: Callable[..., Any],
                 sizes: Sequence[int], name: str):
        self.run, self.eager, self.name = run, eager, name
        self.sizes = sorted(sizes)
        self.pad_inputs = list(boundary.pad_inputs)
        self.size_inputs = list(boundary.size_inputs)
        self.out_dims = list(boundary.out_dims)
        self.size_outputs = set(boundary.size_outputs)
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
            count("capture_size_overflows")
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

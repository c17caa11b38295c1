"""`compile_partition`: the runtime's entry point for one captured partition of a split Dynamo graph."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from .model_runtime import ModelRuntime
from .runner import PartitionRunner

__all__ = ["compile_partition"]


def _tuple_returning(gm: fx.GraphModule) -> Tuple[Optional[type], fx.GraphModule]:
    """(container type of gm's result, or None for a single value; a tuple-returning copy for aot)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    result = output.args[0]
    if type(result) is tuple:
        return tuple, gm
    graph = fx.Graph()
    copied = graph.graph_copy(gm.graph, {})
    if isinstance(result, (list, tuple)):
        graph.output(tuple(copied))
        return type(result), fx.GraphModule(gm, graph)
    graph.output((copied,))
    return None, fx.GraphModule(gm, graph)


def compile_partition(submod: fx.GraphModule, example_inputs: Sequence[Any], *, name: str,
                      static_input_indices: Sequence[int], runtime: ModelRuntime,
                      location: Optional[str] = None, frame: Optional[str] = None,
                      input_names: Sequence[str] = (), batch_symbol: Optional[str] = None) -> Callable[..., Any]:
    """Wrap one captured partition of a split Dynamo graph.

    Returns a callable with submod's calling convention (positional args; returns what submod returns).
    It compiles and captures lazily, at run time, with real tensors. `static_input_indices` are the
    positions of parameters/buffers (nn.Parameter arguments and tensors Dynamo marked with
    `_dynamo_static_input_type` count as static too). `location` ("file:line") goes into fallback warnings,
    `frame` (the Dynamo frame's function and file:line) into the graphs' labels.
    `input_names` (per submod input) into a failed capture's reason. A partition with a symbolic size among its
    example inputs (its sizes vary) shares output memory across sizes (arena.py); `batch_symbol` (capture_sizes:
    the frame's batch symbol, "s0") lets its arenas be sized for the largest declared size at once.
    When nothing would be captured or compiled (eager driver and eager inner compiler), submod itself is
    returned: the cheapest host path.
    """
    driver = runtime.driver_for(example_inputs)
    if not driver.captures and not runtime.config.fuses_with_inductor(driver.name):
        return submod
    sized = any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(
        isinstance(d, torch.SymInt) for d in v.shape)) for v in example_inputs)
    batch_at = next(((i, d) for i, v in enumerate(example_inputs) if isinstance(v, torch.Tensor)
                     for d, n in enumerate(v.shape) if batch_symbol is not None and str(n) == batch_symbol), None)
    static_shapes = not sized and any(isinstance(v, torch.Tensor) for v in example_inputs)
    # A static input with a symbolic size (a KV cache sized by the batch that capture_sizes pads) is a new tensor
    # at every size: it cannot be read in place at a fixed address.
    static = [i for i in static_input_indices
              if not (i < len(example_inputs) and isinstance(example_inputs[i], torch.Tensor)
                      and any(isinstance(d, torch.SymInt) for d in example_inputs[i].shape))]
    return PartitionRunner(submod, _tuple_returning(submod), name, static, runtime, location, driver, frame,
                           input_names, sized, batch_at, static_shapes)

"""Planning one Dynamo graph: the graph rewrites that come first, then the plan (planner.py) for the current grad
mode and the config's scope. The backend (backend.py) compiles what this plans; `explain()` (explain.py) only
reads it, so neither this nor explain imports the runtime."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from .config import CudaGraphConfig, CudaGraphImpl, InferenceCudaGraphScope
from .devices import device_of
from .passes.batch_rows import batch_boundary, batch_padding_blocker, batch_symbol, first_batch
from .passes.fsdp import resharded_inputs
from .plan import BLOCK_SCOPE, LAYER_SCOPE, OFF_SCOPE, GraphPlan
from .planner import plan_graph
from .rewrites.checkpoint_inline import inline_checkpoints
from .rewrites.padding import pad_dynamic_rows
from .rewrites.scalar_reads import hoist_scalar_input_reads
from .tag_selection import selected_tags

__all__ = ["make_plan", "scope_for"]


def scope_for(config: CudaGraphConfig, training: bool) -> Optional[str]:
    """Which planning scope applies; None when this kind of graph is not captured at all."""
    if config.cuda_graph_impl == CudaGraphImpl.FULL_ITERATION:
        return BLOCK_SCOPE
    if training:
        return LAYER_SCOPE
    inference = config.inference_cuda_graph_scope
    if inference == InferenceCudaGraphScope.BLOCK:
        return BLOCK_SCOPE
    if inference == InferenceCudaGraphScope.LAYER:
        return LAYER_SCOPE
    return None


def make_plan(gm: fx.GraphModule, example_inputs: Sequence[Any], config: CudaGraphConfig, index: int, *,
              validate_tags: bool = True, model_tagged: Optional[bool] = None) -> GraphPlan:
    """Plan one Dynamo graph for the current grad mode (hoisting scalar-input reads first, see split.py)."""
    training = torch.is_grad_enabled()
    scope = scope_for(config, training)
    inline_checkpoints(gm, selected_tags(config) if scope == LAYER_SCOPE else frozenset())
    hoist_scalar_input_reads(gm)
    pad_dynamic_rows(gm, config)
    graph_plan = plan_graph(gm, config, index, training=training, device=device_of(example_inputs).type,
                            scope=scope or OFF_SCOPE, validate_tags=validate_tags, model_tagged=model_tagged,
                            input_findings=resharded_inputs(gm, example_inputs, config.fsdp_keep_unsharded))
    if config.capture_sizes:
        sym = batch_symbol(gm)
        graph_plan.static_batch_of_one = sym is None and first_batch(gm) == 1
        if sym is not None:
            graph_plan.batch_symbol = str(sym)
            graph_plan.batch_padding_refused = batch_padding_blocker(gm, sym)
            if graph_plan.batch_padding_refused is None:
                graph_plan.batch_boundary = batch_boundary(gm, sym)
    return graph_plan

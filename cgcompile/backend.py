"""The Dynamo backend "cudagraph_modules": config -> passes -> plan -> split -> runtime per partition.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so `torch.compile(m,
backend="cudagraph_modules", options={...})` works without importing cgcompile. torch.compile passes `options`
and `mode` as keyword arguments.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.fx as fx

from .config import CudaGraphConfig, CudaGraphImpl, InferenceCudaGraphScope
from .diagnostics import full_iteration_error, log_graph_plan
from .errors import ConfigError
from .logs import register_with_torch_logs
from .partition import BLOCK_SCOPE, LAYER_SCOPE, OFF_SCOPE, GraphPlan, plan_graph, split

register_with_torch_logs()

_graph_counter = itertools.count()
_listeners = threading.local()


def device_of(example_inputs: Sequence[Any]) -> str:
    """The device type the graph runs on: the first accelerator among its tensor inputs, else cpu."""
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    return next((d for d in sorted(devices) if d != "cpu"), "cpu")


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


def make_plan(gm: fx.GraphModule, example_inputs: Sequence[Any], config: CudaGraphConfig,
              index: int) -> GraphPlan:
    training = torch.is_grad_enabled()
    scope = scope_for(config, training)
    device = device_of(example_inputs)
    return plan_graph(gm, config, index, training=training, device=device, scope=scope or OFF_SCOPE)


class _PlanListener:
    """Collects the GraphPlans made on this thread while active (used by tests and tools)."""

    def __init__(self) -> None:
        self.graphs: List[GraphPlan] = []

    def __enter__(self) -> "_PlanListener":
        stack = getattr(_listeners, "stack", None)
        if stack is None:
            stack = _listeners.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _listeners.stack.remove(self)


def record_plans() -> _PlanListener:
    """`with record_plans() as rec: compiled(x)` -> rec.graphs holds the plans of graphs compiled meanwhile."""
    return _PlanListener()


def cudagraph_modules(gm: fx.GraphModule, example_inputs: List[Any], options: Optional[dict] = None,
                      mode: Optional[str] = None, **unused: Any) -> Callable[..., Any]:
    """Dynamo backend entry point."""
    if mode not in (None, "default"):
        raise ConfigError(f"mode={mode!r} is not supported by backend 'cudagraph_modules' (modes belong to inductor); "
                          f"set capture through options, e.g. options={{'cuda_graph_impl': 'local'}}")
    if unused:
        raise ConfigError(f"unexpected backend arguments {sorted(unused)}; pass settings as options={{...}}")
    config = CudaGraphConfig.from_options(options)
    graph_plan = make_plan(gm, example_inputs, config, next(_graph_counter))
    for listener in getattr(_listeners, "stack", ()):
        listener.graphs.append(graph_plan)
    log_graph_plan(graph_plan, config)
    if config.cuda_graph_impl == CudaGraphImpl.FULL_ITERATION and not all(p.captured for p in graph_plan.partitions):
        raise ConfigError(full_iteration_error(graph_plan))
    return compile_frame(gm, example_inputs, graph_plan, config)


def compile_frame(gm: fx.GraphModule, example_inputs: Sequence[Any], graph_plan: GraphPlan,
                  config: CudaGraphConfig) -> Callable[..., Any]:
    """Split the graph by plan and run each partition (captured partitions through the runtime)."""
    if not graph_plan.captured:
        return gm.forward
    return split(gm, graph_plan).forward

"""The Dynamo backend "cudagraph_modules": config -> passes -> plan -> split -> runtime per partition.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so `torch.compile(m,
backend="cudagraph_modules", options={...})` works without importing cgcompile. torch.compile passes `options`
and `mode` as keyword arguments.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import threading
from typing import Any, Callable, List, Optional, Sequence

import torch.fx as fx

from .config import CudaGraphConfig, CudaGraphImpl, DynamicPadding
from .diagnostics import full_iteration_error, log_graph_plan
from .errors import ConfigError
from .frame_root import anchor_module_stacks, frame_module, frame_root, running_model
from .logs import register_with_torch_logs
from .passes import input_description, is_static_placeholder
from .passes.common import first_location, frame_name
from .runtime.frame.capture_sizes import BatchPadding
from .devices import device_of
from .frame_plan import make_plan
from .runtime.frame.fsdp import keeper_for
from .runtime.local.lineage import lineage_of
from .runtime.local.model_runtime import ModelRuntime
from .runtime.local.compile import compile_partition
from .runtime.local.serialized import one_call_at_a_time
from .runtime.release import release
from .runtime.frame.te import TEFrame, resolve_graphing_fn
from .runtime.frame.unpadded import UnpaddedOnFallback
from .runtime.frame.verify import VerifiedPartition
from .plan import GraphPlan, submodule_name
from .rewrites import copy_graph_module
from .rewrites.checkpoint_eager import run_checkpoints_eagerly
from .rewrites.shared_inputs import share_inputs
from .scope import LayerScope, ScopedFrame, scope_config
from .split import call_directly, plain_forward, replace_submodule, split
from .tagging import tag_of
from .untraced import skip_own_frames

register_with_torch_logs()

_graph_counter = itertools.count()
_listeners = threading.local()


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
    skip_own_frames()  # before any graph of ours runs: Dynamo never traces cgcompile's own code (untraced.py)
    root = frame_root()
    anchor_module_stacks(gm, root)  # a frame after a graph break inside a module starts at that module
    model = running_model()
    tagged = None if model is None else any(tag_of(module) for module in model.modules())
    if scope_config(config, LayerScope.FULL) == config:  # a scope transition (scope.py) would change nothing
        return plan_and_compile(gm, example_inputs, config, next(_graph_counter), root, tagged)
    # Dynamo traces once; each capture scope is planned from its own copy of the graph at its first call
    pristine, unplanned = copy_graph_module(gm), [gm]

    def build(scope: LayerScope, args: Sequence[Any]) -> Callable[..., Any]:
        graph = unplanned.pop() if unplanned else copy_graph_module(pristine)
        return plan_and_compile(graph, args, scope_config(config, scope), next(_graph_counter), root, tagged)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    probe = next((i for i, n in enumerate(placeholders) if is_static_placeholder(n)), None)
    frame = ScopedFrame(build, probe, frame_module())
    frame.prepare(example_inputs)
    return frame.entry


def plan_and_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], config: CudaGraphConfig, index: int,
                     root: Any, model_tagged: Optional[bool] = None) -> Callable[..., Any]:
    """Plan one Dynamo graph (mutating it), tell the plan listeners and the log, compile it. `model_tagged`:
    whether the model the user called carries any tag (None: no model is running, a compiled function)."""
    # dynamic_padding rewrites gm: the graph as Dynamo gave it is kept for a local frame that gives padding up
    unpadded_gm = copy_graph_module(gm) if config.dynamic_padding is not DynamicPadding.OFF \
        and config.cuda_graph_impl == CudaGraphImpl.LOCAL else None
    # a submodule's frame is a fragment of the model (Dynamo broke around it): it may hold none of the
    # selected tags (a decoder layer's attention half when "moe" is selected), so only whole frames are checked
    graph_plan = make_plan(gm, example_inputs, config, index, validate_tags=root is None, model_tagged=model_tagged)
    for listener in getattr(_listeners, "stack", ()):
        listener.graphs.append(graph_plan)
    log_graph_plan(graph_plan, config)
    if config.cuda_graph_impl == CudaGraphImpl.FULL_ITERATION:
        check_one_graph(gm, graph_plan)
    run = compile_frame(gm, example_inputs, graph_plan, config)
    padded = [graph_plan.runner_name(p) for p in graph_plan.partitions if p.captured and p.padding]
    if not padded or unpadded_gm is None:
        return run
    unpadded = dataclasses.replace(config, dynamic_padding=DynamicPadding.OFF, dynamic_padding_buckets=())
    # planned at the switch from that call's arguments, as ScopedFrame plans a scope: no first call's tensor kept
    return UnpaddedOnFallback(run, padded, lambda args: plan_and_compile(unpadded_gm, args, unpadded,
                                                                         next(_graph_counter), root,
                                                                         model_tagged),
                              f"graph {graph_plan.index}")


_RESUME = re.compile(r'File "([^"]+)", line \d+, in torch_dynamo_resume_in_\w+_at_(\d+)')


def check_one_graph(gm: fx.GraphModule, graph_plan: GraphPlan) -> None:
    """full_iteration captures the frame as one graph: no eager island inside it, and no Dynamo graph break
    before it (a graph Dynamo resumed after a break carries `torch_dynamo_resume_in_<fn>_at_<line>` frames)."""
    if not all(p.captured for p in graph_plan.partitions):
        raise ConfigError(full_iteration_error(graph_plan))
    for node in gm.graph.nodes:
        found = _RESUME.search(node.meta.get("stack_trace") or "")
        if found:
            raise ConfigError(
                f"cuda_graph_impl='full_iteration' needs the whole step in one graph, but Dynamo broke the graph at "
                f"{found.group(1)}:{found.group(2)}; run cgcompile.explain(...) or torch.compile(..., fullgraph=True) "
                f"to see why, or use cuda_graph_impl='local' to capture around it.")


def compile_frame(gm: fx.GraphModule, example_inputs: Sequence[Any], graph_plan: GraphPlan,
                  config: CudaGraphConfig) -> Callable[..., Any]:
    """Split the graph by plan; captured partitions go to the runtime of `cuda_graph_impl`, eager ones run as
    plain FX code. A graph with nothing to capture runs unsplit (no extra host overhead)."""
    if not graph_plan.captured:
        return plain_forward(gm)
    # which recompile of which code this frame is (runtime/local/lineage.py)
    lineage = lineage_of([n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"],
                         graph_plan.training)
    # the device with its index: the plan keeps only the type
    runtime = ModelRuntime(config, device_of(example_inputs), graph_plan, lineage)
    if config.cuda_graph_impl != CudaGraphImpl.TRANSFORMER_ENGINE and not runtime.driver.captures \
            and not config.fuses_with_inductor(runtime.driver.name):
        return plain_forward(gm)  # nothing to capture or compile (e.g. driver=auto on CPU): splitting only adds calls
    if config.cuda_graph_impl != CudaGraphImpl.TRANSFORMER_ENGINE:
        graph_plan = share_inputs(gm, graph_plan)  # a value several graphs read, copied in once (rewrites/)
    static_names = {n.name for n in gm.graph.nodes if is_static_placeholder(n)}
    by_name = {n.name: n for n in gm.graph.nodes}
    split_gm = split(gm, graph_plan)
    captured = [p for p in graph_plan.partitions if p.captured]
    names = [submodule_name(p.id) for p in captured]
    if config.cuda_graph_impl == CudaGraphImpl.TRANSFORMER_ENGINE:
        for partition in (p for p in graph_plan.partitions if not p.captured):  # TEFrame calls the split graph
            eager = getattr(split_gm, submodule_name(partition.id))  # whole: its eager parts as written
            if run_checkpoints_eagerly(eager):
                eager.recompile()
        graphing_fn, te_options = resolve_graphing_fn(config.te)
        return TEFrame(split_gm, names, graphing_fn, te_options, config.cuda_graph_warmup_steps,
                       clone_outputs=config.clone_outputs, device=device_of(example_inputs))

    for name, partition in zip(names, captured):
        submod = getattr(split_gm, name)
        runner_name = graph_plan.runner_name(partition)
        inputs = [n for n in submod.graph.nodes if n.op == "placeholder"]
        first = partition.reasons[0].location if partition.reasons else None
        wrapped = compile_partition(
            submod, [n.meta.get("example_value") for n in inputs], name=runner_name,
            static_input_indices=[i for i, n in enumerate(inputs) if n.name in static_names], runtime=runtime,
            location=first or first_location(submod), frame=frame_name(submod),
            input_names=[input_description(by_name[n.name]) if n.name in by_name else n.name for n in inputs],
            batch_symbol=graph_plan.batch_symbol if graph_plan.batch_boundary is not None else None)
        if config.verify:
            wrapped = VerifiedPartition(wrapped, submod, runner_name, config.verify,
                                        skip=config.cuda_graph_warmup_steps)
        if wrapped is not submod:
            replace_submodule(split_gm, name, wrapped)
    # outputs leave the frame copied out of graph memory (ModelRuntime.finish_frame_outputs; clone_outputs)
    forward = call_directly(split_gm, finish=runtime.finish_frame_outputs if config.clone_outputs else None)
    # FSDP2 parameters that captured partitions read keep their address (runtime/frame/fsdp.py); None otherwise
    keeper = keeper_for(gm, example_inputs, frozenset(n for p in captured for n in p.nodes),
                        f"graph {graph_plan.index}")

    def keeping(*args: Any) -> Any:
        keeper.keep(args)
        return forward(*args)

    # the frame calls `forward` itself unless FSDP2's parameters are kept first (the lock's wrapper carries .runtime)
    run = forward if keeper is None else keeping
    if graph_plan.batch_boundary is not None:
        run = BatchPadding(graph_plan.batch_boundary, run, plain_forward(gm), config.capture_sizes,
                           f"graph {graph_plan.index}")
    return one_call_at_a_time(run, runtime)  # threads sharing the model: one call at a time (its graphs' memory)


# torch.compile wraps the backend in torch._TorchCompileWrapper, whose reset() (called by torch._dynamo.reset(),
# 2.11 and 2.13: eval_frame._reset_guarded_backend_cache) calls the backend's own `reset` when it has one.
cudagraph_modules.reset = release  # type: ignore[attr-defined]



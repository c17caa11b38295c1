"""FX surgery on a planned graph: cut the graph into one
submodule per partition (torch.fx.passes.split_module; keep_original_order=True keeps unbacked symbols defined
before their uses), and swap a submodule for its runtime wrapper."""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Tuple

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from .passes.state_switches import grad_mode_after
from .plan import GraphPlan
from .rewrites.checkpoint_eager import run_checkpoints_eagerly


def split(gm: fx.GraphModule, graph_plan: GraphPlan) -> fx.GraphModule:
    """Cut the graph into one submodule per partition, named `submod_<partition id>`, each left in the grad mode
    it was entered with (see close_grad_mode)."""
    owner = graph_plan.node_to_partition
    default = graph_plan.partitions[0].id if graph_plan.partitions else 0

    def callback(node: fx.Node) -> int:
        return owner.get(node.name, default)

    split_gm = split_module(gm, None, callback, keep_original_order=True)
    close_grad_mode(gm, split_gm, graph_plan.training)
    take_in_frame_order(split_gm)
    return split_gm


def take_in_frame_order(split_gm: fx.GraphModule) -> None:
    """A split graph that is one call of one partition taking every frame argument (a frame captured whole, e.g.
    inference scope block) passes them in the partition's order of first use, which split_module gives its
    placeholders: put the partition's placeholders in the frame's order instead, so that the call passes the
    frame's own argument tuple on (single_call) rather than building a new one per step, an item per parameter."""
    placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
    calls = [n for n in split_gm.graph.nodes if n.op == "call_module"]
    if len(calls) != 1 or calls[0].kwargs or len(calls[0].args) != len(placeholders) \
            or set(calls[0].args) != set(placeholders) or list(calls[0].args) == placeholders:
        return
    call = calls[0]
    submod = getattr(split_gm, str(call.target))
    inputs = [n for n in submod.graph.nodes if n.op == "placeholder"]
    by_argument = dict(zip(call.args, inputs))
    for node in reversed(placeholders):  # each moved to the front: the frame's first argument ends up first
        first = next(iter(submod.graph.nodes))
        if first is not by_argument[node]:
            first.prepend(by_argument[node])
    call.args = tuple(placeholders)
    submod.recompile()
    split_gm.recompile()


def close_grad_mode(gm: fx.GraphModule, split_gm: fx.GraphModule, entry: bool) -> None:
    """Make every partition leave grad mode as it found it, so none can be traced, captured or replayed with a
    no_grad block left open (aot would trace the rest of the caller under it). split_module already re-enters
    the mode at the start of each later partition; here each submodule restores the frame's entry mode before
    returning, and the frame ends in the mode the original graph ends in."""
    for name, submod in split_gm.named_children():
        if isinstance(submod, fx.GraphModule) and _restore_grad_mode(submod, entry):
            submod.recompile()
    final = grad_mode_after(gm, entry)[next(n for n in reversed(gm.graph.nodes) if n.op == "output")]
    if _restore_grad_mode(split_gm, entry, final):
        split_gm.recompile()


def _restore_grad_mode(gm: fx.GraphModule, entry: bool, target: Optional[bool] = None) -> bool:
    """Insert `_set_grad_enabled(target)` (default: `entry`) before gm's output where gm, entered with `entry`,
    would end in another mode. True if it changed gm."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    target = entry if target is None else target
    if grad_mode_after(gm, entry)[output] == target:
        return False
    with gm.graph.inserting_before(output):
        gm.graph.call_function(torch._C._set_grad_enabled, (target,))
    return True


def replace_submodule(split_gm: fx.GraphModule, name: str, fn) -> None:
    """Make the split graph call `fn` (a module or any callable) in place of its submodule `name`. A plain
    callable is stored as a plain attribute: the generated forward calls `self.<name>(...)` directly, without
    nn.Module.__call__'s hook dispatch on every call."""
    delattr(split_gm, name)
    if isinstance(fn, torch.nn.Module):
        setattr(split_gm, name, fn)
    else:
        object.__setattr__(split_gm, name, fn)


def plain_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """gm's generated forward, compiled now. Graph modules made under Dynamo are lazy (torch.fx's
    _LazyGraphModule): until compiled their `forward` is a stub that compiles the code and then calls the module
    through nn.Module.__call__, on every call when the stub itself was kept (a frame's `forward = gm.forward`).
    `real_recompile` is that class's public method; an eager graph module has none and is compiled already.
    Its activation checkpoints run as the user's eager code runs them (rewrites/checkpoint_eager.py)."""
    if run_checkpoints_eagerly(gm):
        gm.recompile()
    recompile = getattr(gm, "real_recompile", None)
    if recompile is not None:
        recompile()
    return gm.forward


def call_directly(split_gm: fx.GraphModule, finish: Optional[Callable[[Any], Any]] = None) -> Callable[..., Any]:
    """The split graph's forward with every submodule still in it (its eager partitions) called through its plain
    generated forward, a plain attribute: per step, no nn.Module.__call__ (hooks, the lazy stub) per partition.
    A split graph that is one call of one partition (a frame captured whole, e.g. inference scope block) is that
    call alone (`single_call`). With `finish`, what the frame does with its outputs as they leave it, the result
    is finished: by the partition itself where it can (single_call), else by `finish`."""
    for name, submod in list(split_gm.named_children()):
        if isinstance(submod, fx.GraphModule):
            replace_submodule(split_gm, name, plain_forward(submod))
    direct = single_call(split_gm, finished=finish is not None)
    forward, done = direct if direct is not None else (plain_forward(split_gm), False)
    if done or finish is None:
        return forward

    def finished(*args: Any) -> Any:
        return finish(forward(*args))
    return finished


def single_call(split_gm: fx.GraphModule, finished: bool = False) -> Optional[Tuple[Callable[..., Any], bool]]:
    """For a split graph whose only work is one call of one partition, fed straight by the frame's arguments and
    returned whole or by its items: a function doing just that, or None for any other graph. The generated
    forward would rename each argument, pass them on and clear each name again: per step, three bytecodes per
    argument (a frame of a decoder block passes every parameter), where picking them costs one C call.
    Returned with whether the function also finishes the frame's outputs: asked to (`finished`), a partition
    returned whole that hands its result out itself as it leaves the frame (`leaving`: a PartitionRunner) does."""
    nodes = list(split_gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_module"]
    if len(calls) != 1 or calls[0].kwargs or nodes[-1].op != "output":
        return None
    call, (returned,) = calls[0], nodes[-1].args
    position = {node: i for i, node in enumerate(placeholders)}
    if not all(isinstance(a, fx.Node) and a in position for a in call.args) or not isinstance(returned, (tuple, list)):
        return None
    items = [None if r is call else r.args[1] if _is_item_of(r, call) else -1 for r in returned]
    if -1 in items or (None in items and len(items) != 1) \
            or len(nodes) != len(placeholders) + 2 + (0 if items == [None] else len(items)):
        return None  # work of its own besides the call and its items
    partition = getattr(split_gm, str(call.target))
    order = [position[a] for a in call.args]
    if order == list(range(len(placeholders))):
        pick = tuple  # the arguments as they come (a tuple already: the same object, no copy)
    elif len(order) > 1:
        pick = operator.itemgetter(*order)
    else:
        def pick(args: tuple) -> tuple:
            return tuple([args[i] for i in order])
    if items == [None]:
        if finished and hasattr(partition, "leaving"):  # it hands its result out as it leaves the frame (a
            # PartitionRunner; looked up per call, as a call of the partition itself would be)
            if pick is tuple and hasattr(partition, "frame_call"):  # the frame's arguments as they come: the
                return partition.frame_call(), True  # runner's own callable for this call

            def whole_leaving(*args: Any) -> tuple:
                return partition.leaving(pick(args))
            return whole_leaving, True

        def whole(*args: Any) -> tuple:
            return (partition(*pick(args)),)
        return whole, False

    def by_items(*args: Any) -> tuple:
        out = partition(*pick(args))
        return tuple([out[i] for i in items])
    return by_items, False


def _is_item_of(node: Any, call: fx.Node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem \
        and node.args[0] is call and isinstance(node.args[1], int) and len(node.users) == 1

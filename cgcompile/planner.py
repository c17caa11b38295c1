"""The planning rules: which node runs in which partition, captured or eager, and why (the plan: plan.py).

`plan_graph` is a pure function of the FX graph and the normalized config; split.py cuts the graph by the plan.
Region rules:
- with `cuda_graph_modules` set, only ops inside modules carrying a selected tag are captured; a selected region
  that contains an uncapturable op is left eager as a whole (the plan names the op), or raises with `strict`;
- untagged, capture-safe glue next to a captured region of the same layer is absorbed, and adjacent captured
  regions of one layer merge into one graph (fewer replays), unless `strict_modules`;
- with `cuda_graph_modules` empty ("whole layer"), every capture-safe span is captured, cut at layer boundaries,
  each cut between two captured layers placed just before the later one's first matmul (no fusion lost there);
- the "block" scope (inference block scope, full_iteration) captures maximal capture-safe spans, ignoring modules;
- captured runs shorter than `min_partition_ops` stay eager: replay has a fixed cost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.fx as fx

from .config import CudaGraphConfig, CudaGraphImpl
from .errors import ConfigError
from .passes import RegionInfo, analyze, compute_nodes, module_regions, node_location
from .passes.checkpoints import (body_modules, checkpoint_location, checkpoint_of_item, op_count, tags_inside,
                                 whole_checkpoint_region)
from .passes.common import counts_as_op, node_module_path, op_name
from .passes.dtensor import redistributions
from .passes.padding_marks import PADDED
from .passes.state_switches import functorch_spans, is_state_node, state_effect
from .plan import BLOCK_SCOPE, CAPTURE, EAGER, LAYER_SCOPE, OFF_SCOPE, GraphPlan, Partition
from .reasons import Finding, Reason
from .tag_selection import check_selection, selected_tags


def layer_of(module: Optional[str]) -> Optional[str]:
    """The layer a module path belongs to: the path up to its first numeric component ("layers.3.attn" ->
    "layers.3"); None for modules outside any numbered container."""
    if not module:
        return None
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def common_module(paths: Sequence[Optional[str]]) -> Optional[str]:
    """Longest common module path of the given paths (component-wise), None when they share only the root."""
    split = [p.split(".") for p in paths if p]
    if not split or len(split) != len(paths):
        return None
    prefix = split[0]
    for parts in split[1:]:
        n = 0
        while n < min(len(prefix), len(parts)) and prefix[n] == parts[n]:
            n += 1
        prefix = prefix[:n]
    return ".".join(prefix) or None


@dataclass
class _Run:
    """A run of nodes being grouped: kind, the region key that may not change within it, and the layer.
    `too_small`: a captured run left eager by min_partition_ops (its reason is too_small, not its region's)."""

    kind: str
    key: object
    layer: Optional[str]
    nodes: List[fx.Node]
    glue: bool = False
    too_small: bool = False
    lead: Optional[List[fx.Node]] = None  # the next layer's ops moved in ahead of its first matmul (not its module)


def plan_graph(gm: fx.GraphModule, config: CudaGraphConfig, index: int = 0, *, training: bool = True,
               device: str = "cpu", scope: Optional[str] = None, validate_tags: bool = True,
               input_findings: Optional[Mapping[str, Finding]] = None,
               model_tagged: Optional[bool] = None) -> GraphPlan:
    """Plan one Dynamo graph. `scope` is "layer" (module regions) or "block" (maximal capture-safe spans);
    by default "block" for full_iteration, else "layer". `input_findings` (placeholder name -> Finding): inputs
    no graph may read (e.g. FSDP2 parameters re-gathered at new addresses); the ops reading them stay eager."""
    if scope is None:
        scope = BLOCK_SCOPE if config.cuda_graph_impl == CudaGraphImpl.FULL_ITERATION else LAYER_SCOPE
    findings = analyze(gm)
    regions = module_regions(gm)
    # Global-state nodes (grad mode, autocast, functorch levels) are not ops: they are placed with the ops they
    # govern once the partitions stand (_place_state_nodes), so they never make islands of their own.
    nodes = [n for n in compute_nodes(gm) if not is_state_node(n)]
    selected = selected_tags(config) if scope == LAYER_SCOPE else frozenset()
    if selected:
        check_selection(gm, config, regions, whole_frame=validate_tags, model_tagged=model_tagged)

    blocking: Dict[fx.Node, Finding] = {}
    for node in nodes:
        info = regions[node]
        if info.eager_module is not None:
            blocking[node] = Finding(Reason.EAGER_REGION, op_name(node), node_location(node), node_module_path(node),
                                     hint="the module is marked cgcompile.eager_region",
                                     detail=f"inside eager_region {info.eager_module}")
        elif node in findings:
            blocking[node] = findings[node][0]
        elif input_findings:
            found = next((input_findings[a.name] for a in node.all_input_nodes if a.name in input_findings), None)
            if found is not None:
                blocking[node] = replace(found, op=op_name(node), location=node_location(node),
                                         module=node_module_path(node))
    _keep_functorch_levels_whole(gm, regions, blocking)

    if scope == OFF_SCOPE:
        runs = [_Run(EAGER, None, None, nodes)] if nodes else []
    elif selected:
        runs = _selected_runs(nodes, regions, blocking, selected, config)
    else:
        runs = _span_runs(nodes, regions, blocking, cut_layers=scope == LAYER_SCOPE,
                          min_ops=config.min_partition_ops)

    partitions = _place_state_nodes(gm, _finish(runs, regions, blocking, selected, config, scope))
    partitions = _note_redistributions(gm, partitions)
    if config.cuda_graph_impl == CudaGraphImpl.NONE:
        partitions = [_disabled(p) for p in partitions]
    all_findings = {n.name: tuple(findings.get(n, ())) for n in nodes if n in findings}
    return GraphPlan(index, partitions, scope, device, training, all_findings)


def _note_redistributions(gm: fx.GraphModule, partitions: List[Partition]) -> List[Partition]:
    """Record in each partition the collectives of its DTensor redistributions (passes/dtensor.py): a captured
    partition captures them with its forward graph, and their gradients' collectives with its backward graph."""
    found = redistributions(gm)
    if not found:
        return partitions
    owner = {name: p.id for p in partitions for name in p.nodes}
    per_partition: Dict[int, List] = {}
    for node, collectives in found.items():
        if node.name in owner:
            per_partition.setdefault(owner[node.name], []).extend(collectives)
    return [replace(p, redistributions=tuple(per_partition.get(p.id, ()))) for p in partitions]


def _keep_functorch_levels_whole(gm: fx.GraphModule, regions: Dict[fx.Node, RegionInfo],
                                 blocking: Dict[fx.Node, Finding]) -> None:
    """Make every op of one functorch level plan alike, so the level lands in one partition: one region (Dynamo
    leaves the pop without a module stack) and, if any op of it cannot be captured, that op's finding on all."""
    for span in functorch_spans(gm):
        ops = [n for n in span if not is_state_node(n)]
        if not ops:
            continue
        region = next((regions[n] for n in ops if regions[n].module is not None), regions[ops[0]])
        first_block = next((blocking[n] for n in ops if n in blocking), None)
        for node in ops:
            regions[node] = region
            if first_block is not None:
                blocking.setdefault(node, first_block)


def _place_state_nodes(gm: fx.GraphModule, partitions: List[Partition]) -> List[Partition]:
    """Put each global-state node in the partition of the op it governs: a grad-mode switch or a block's entry
    with the next op, a block's exit with the previous one (split_module re-enters grad mode and autocast in
    every later partition, and split() closes them at each partition's end)."""
    owner = {name: p for p in partitions for name in p.nodes}
    order = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    compute = list(compute_nodes(gm))
    placed: Dict[int, List[str]] = {}
    for i, node in enumerate(compute):
        effect = state_effect(node)
        if effect is None:
            continue
        after = [n for n in compute[i + 1:] if n.name in owner]
        before = [n for n in reversed(compute[:i]) if n.name in owner]
        neighbours = before + after if effect == "exit" else after + before
        if neighbours:
            placed.setdefault(owner[neighbours[0].name].id, []).append(node.name)
    for partition in partitions:
        if partition.id in placed:
            partition.nodes = tuple(sorted(partition.nodes + tuple(placed[partition.id]), key=order.__getitem__))
    return partitions


def _span_runs(nodes, regions, blocking, *, cut_layers: bool, min_ops: int) -> List[_Run]:
    runs: List[_Run] = []
    for node in nodes:
        kind = EAGER if node in blocking else CAPTURE
        layer = layer_of(regions[node].module)
        key = layer if (cut_layers and kind == CAPTURE) else None
        if runs and runs[-1].kind == kind and runs[-1].key == key:
            runs[-1].nodes.append(node)
        else:
            runs.append(_Run(kind, key, layer, [node]))
    # The layer cut is a heuristic (one graph per layer): it must not leave capture-safe work eager. A captured
    # run below min_ops joins its captured neighbour across the cut (nn.Sequential's children are "layers" of
    # one op each) before _finish applies the size rule.
    merged: List[_Run] = []
    for run in runs:
        last = merged[-1] if merged else None
        if last is not None and last.kind == run.kind == CAPTURE and min(_ops(last), _ops(run)) < min_ops:
            last.nodes.extend(run.nodes)
            last.key = last.layer = common_module([last.layer, run.layer])
        else:
            merged.append(run)
    return _cut_before_matmuls(merged, min_ops)


# ops Inductor runs as extern kernels (GEMMs, attention, convolutions): a cut just before one loses no fusion
_MATMULS = {"F.linear", "torch.matmul", "torch.mm", "torch.bmm", "torch.baddbmm", "torch.addmm", "torch.einsum",
            "F.scaled_dot_product_attention", "operator.matmul", "Tensor.matmul", "Tensor.mm", "Tensor.bmm",
            "torch._grouped_mm", "F.grouped_mm", "F.conv1d", "F.conv2d", "F.conv3d", "torch.conv1d", "torch.conv2d",
            "torch.conv3d"}


def _cut_before_matmuls(runs: List[_Run], min_ops: int) -> List[_Run]:
    """Move each layer cut between two captured runs to just before the later run's first matmul: the ops ahead
    of it (the next layer's input norm after the residual add, the final norm) then run in the graph that makes
    their input, where Inductor fuses them with it (in the backward too); a cut at the matmul's input cuts no
    fusion, since the matmul is an extern kernel that reads its input from memory either way. Not where the
    later run would be left below min_ops (it would run eagerly)."""
    for before, after in zip(runs, runs[1:]):
        if before.kind != CAPTURE or after.kind != CAPTURE:
            continue
        first = next((i for i, n in enumerate(after.nodes) if op_name(n) in _MATMULS), None)
        if not first or sum(map(op_count, after.nodes[first:])) < min_ops:
            continue
        head = after.nodes[:first]
        before.nodes.extend(head)
        before.lead = (before.lead or []) + head
        del after.nodes[:first]
    return runs


def _ops(run: _Run) -> int:
    return sum(map(op_count, run.nodes))


def _module_of(node: fx.Node, regions) -> Optional[str]:
    """A node's module path; for an activation checkpoint (or an item of one), the module its body runs in."""
    modules = body_modules(node)
    return regions[node].module if regions[node].module is not None or modules is None else common_module(modules)


def _selected_runs(nodes, regions, blocking, selected, config) -> List[_Run]:
    region_of = {n: regions[n].innermost_tag(selected) or whole_checkpoint_region(n, selected, config.strict_modules)
                 for n in nodes}
    for node in nodes:  # the items of a checkpoint captured whole go with it
        source = checkpoint_of_item(node)
        if region_of[node] is None and source is not None and source in region_of:
            region_of[node] = region_of[source]
    # A selected region instance that holds an uncapturable op is not captured at all (Megatron cannot either).
    poisoned: Dict[str, List[Finding]] = {}
    for node in nodes:
        region = region_of[node]
        # scalar-input reads run at the top of the graph (hoist_scalar_input_reads), outside every region
        if region is not None and node in blocking and blocking[node].category != Reason.SCALAR_INPUT:
            poisoned.setdefault(region[0], []).append(blocking[node])
    if poisoned and config.strict:
        lines = [f"  {path}: {f.category} {f.op} at {f.location}" for path, fs in poisoned.items() for f in fs]
        raise ConfigError("strict=True: selected regions contain ops that cannot be captured:\n" + "\n".join(lines))

    # Modules that contain a selected region (the "moe" block around "moe_router") are containers: their own
    # ops (reshapes between router and preprocess) are glue, not an unselected region.
    containers = {".".join(path.split(".")[:i]) for region in region_of.values() if region is not None
                  for path in [region[0]] for i in range(len(path.split(".")))}
    runs: List[_Run] = []
    for node in nodes:
        region = region_of[node]
        info = regions[node]
        if node in blocking or (region is not None and region[0] in poisoned):
            kind, key, glue = EAGER, None, False
        elif region is not None:
            kind, key, glue = CAPTURE, region, False
        elif info.tagged and info.tagged[-1][0] not in containers:  # inside a tagged module not selected
            kind, key, glue = EAGER, None, False
        else:
            kind, key, glue = EAGER, ("glue", layer_of(info.module)), True
        layer = layer_of(region[0] if region else info.module)
        if runs and runs[-1].kind == kind and runs[-1].key == key and runs[-1].glue == glue:
            runs[-1].nodes.append(node)
        else:
            runs.append(_Run(kind, key, layer, [node], glue))

    if config.strict_modules:
        return runs
    # Absorb glue (norms, residual adds) next to a captured run of the same layer, then merge captured
    # neighbours of one layer: one graph per layer instead of one per module.
    captured = [run.kind == CAPTURE for run in runs]
    for i, run in enumerate(runs):
        if not run.glue or run.layer is None:
            continue
        neighbours = [j for j in (i - 1, i + 1) if 0 <= j < len(runs) and captured[j]]
        if any(runs[j].layer == run.layer for j in neighbours):
            run.kind = CAPTURE
    merged: List[_Run] = []
    for run in runs:
        last = merged[-1] if merged else None
        if last is not None and last.kind == run.kind == CAPTURE and last.layer is not None \
                and last.layer == run.layer:
            last.nodes.extend(run.nodes)
        else:
            merged.append(run)
    return merged


def _not_captured_reason(node: fx.Node, info: RegionInfo, selected) -> Finding:
    inside = tags_inside(node)
    if any(tag in selected for tag in inside):  # a selective checkpoint not captured whole (whole_checkpoint_region)
        others = [tag for tag in inside if tag not in selected]
        rule = f"every module in it is selected ({', '.join(others)} is not)" if others \
            else "strict_modules is off (the body's glue is captured too)"
        return Finding(Reason.UNTAGGED, op_name(node), checkpoint_location(node), info.module,
                       hint="select every module it holds to capture it whole (aot_autograd applies its policy), or "
                            "checkpoint without context_fn to capture the selected modules in it",
                       detail=f"a selective activation checkpoint (context_fn) holding {', '.join(inside)}: its policy "
                              f"applies to the whole body, captured whole only when {rule}")
    if info.tagged:
        tag = info.tagged[-1][1]
        return Finding(Reason.NOT_SELECTED, op_name(node), checkpoint_location(node), info.module,
                       hint=f"add '{tag}' to cuda_graph_modules to capture it",
                       detail=f"module tag '{tag}' is not in cuda_graph_modules")
    return Finding(Reason.UNTAGGED, op_name(node), checkpoint_location(node), info.module,
                   hint="tag its module with cgcompile.tag(...), or leave cuda_graph_modules empty to capture "
                        "every capture-safe span",
                   detail="not inside a selected module")


def _finish(runs: List[_Run], regions, blocking, selected, config, scope) -> List[Partition]:
    """Apply min_partition_ops, coalesce eager neighbours, and attach tags, module paths and reasons."""
    whole_frame = config.cuda_graph_impl == CudaGraphImpl.FULL_ITERATION  # one graph, however small
    for run in runs:
        if run.kind == CAPTURE and not whole_frame and _ops(run) < config.min_partition_ops:
            run.kind = EAGER
            run.too_small = True
    te_reasons: Dict[int, Finding] = {}
    if config.cuda_graph_impl == CudaGraphImpl.TRANSFORMER_ENGINE:
        for run in runs:
            if run.kind == CAPTURE:
                restriction = _te_restriction(run.nodes)
                if restriction is not None:
                    run.kind = EAGER
                    te_reasons[id(run.nodes[0])] = restriction
    coalesced: List[_Run] = []
    for run in runs:
        if coalesced and coalesced[-1].kind == run.kind == EAGER:
            coalesced[-1].nodes.extend(run.nodes)
            coalesced[-1].too_small = coalesced[-1].too_small or run.too_small
        else:
            coalesced.append(_Run(run.kind, run.key, run.layer, list(run.nodes), run.glue, run.too_small, run.lead))

    partitions = []
    for pid, run in enumerate(coalesced):
        tags: Dict[str, None] = {}
        for node in run.nodes:
            if node in blocking and blocking[node].category == Reason.SCALAR_INPUT:
                continue  # hoisted to the top: its module is where the number is used, not where it runs
            tagged = regions[node].innermost_tag(selected or None)
            if tagged is not None:
                tags.setdefault(tagged[1])
            if run.kind == CAPTURE:  # a checkpoint captured whole: the modules it holds
                tags.update(dict.fromkeys(tags_inside(node)))
        num_ops = _ops(run)
        reasons: Dict[tuple, Finding] = {}
        if run.kind == EAGER:
            for node in run.nodes:
                f = blocking.get(node) or te_reasons.get(id(node))
                if f is not None:
                    reasons.setdefault((f.category, f.op, f.location), f)
            if not reasons:
                node = next((n for n in run.nodes if counts_as_op(n)), run.nodes[0])
                if scope == OFF_SCOPE:
                    f = Finding(Reason.DISABLED, "-", None, None,
                                hint="use cuda_graph_impl='local' with inference_cuda_graph_scope 'layer' or 'block'",
                                detail=f"no-grad graphs are not captured with inference_cuda_graph_scope="
                                       f"'{config.inference_cuda_graph_scope.value}'")
                elif selected and not any(run_node in blocking for run_node in run.nodes) and not run.too_small:
                    f = _not_captured_reason(node, regions[node], selected)
                else:
                    f = Finding(Reason.TOO_SMALL, op_name(node), node_location(node), regions[node].module,
                                hint="lower min_partition_ops to capture it",
                                detail=f"{num_ops} ops < min_partition_ops={config.min_partition_ops}: "
                                       f"replay overhead would eat the gain")
                reasons[(f.category, f.op, f.location)] = f
        lead = set(run.lead or ())
        own = [n for n in run.nodes if n not in lead] or run.nodes
        partitions.append(Partition(pid, run.kind, tuple(tags), common_module([_module_of(n, regions) for n in own]),
                                    num_ops, tuple(reasons.values()), tuple(n.name for n in run.nodes),
                                    _padding_summary(run.nodes)))
    return partitions


def _disabled(partition: Partition) -> Partition:
    """With cuda_graph_impl 'none' nothing runs captured, but the plan keeps the partitions 'local' would
    capture, each eager with the reason, so the user sees what enabling capture would do."""
    if not partition.captured:
        return partition
    reason = Finding(Reason.DISABLED, "-", None, partition.module, hint="set cuda_graph_impl to 'local' to capture",
                     detail="would be captured; cuda_graph_impl is 'none'")
    return dataclasses.replace(partition, kind=EAGER, reasons=(reason,))


def _padding_summary(nodes: Sequence[fx.Node]) -> Optional[dict]:
    """What dynamic_padding did to the rows these nodes work on (padding.py marks the nodes), as plain data."""
    paddings: Dict[object, None] = {}
    for node in nodes:
        if PADDED in node.meta:
            paddings.setdefault(node.meta[PADDED])
    if not paddings:
        return None
    first = next(iter(paddings))
    summary = {"mode": first.mode, "producers": len(paddings), "rows": [p.bound for p in paddings]}
    if first.mode == "buckets":
        summary["buckets"] = list(first.buckets)
    return summary


def _te_restriction(nodes: List[fx.Node]) -> Optional[Finding]:
    """make_graphed_callables takes and returns tensors only: a partition whose boundary carries a SymInt,
    a Python number or None cannot be handed to it."""
    inside = set(nodes)
    for node in nodes:
        crossing = [(arg, "takes") for arg in node.all_input_nodes if arg not in inside]
        if any(user not in inside for user in node.users):
            crossing.append((node, "returns"))
        for value_node, verb in crossing:
            value = value_node.meta.get("example_value", value_node.meta.get("val"))
            values = value if isinstance(value, (list, tuple)) else [value]
            bad = next((v for v in values if not isinstance(v, torch.Tensor)), None)
            if values and bad is not None or value is None:
                return Finding(Reason.TE_RESTRICTION, op_name(node), node_location(node), node_module_path(node),
                               hint="make the value a tensor, or use cuda_graph_impl='local'",
                               detail=f"transformer_engine graphs take and return tensors only; this partition "
                                      f"{verb} {value_node.name} = {value!r}")
    return None

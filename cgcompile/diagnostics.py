"""Plan -> log lines and table. Reads the plan (plan.py, and explain.Plan through its fields); never recomputes it.

Logger "cgcompile": INFO gives one summary line per graph plus its partition table, DEBUG every finding per node.
Works with plain `logging` and with `TORCH_LOGS="+cgcompile"` (registered in logs.py).
"""

from __future__ import annotations

import logging
from typing import List

from .plan import GraphPlan
from .passes.common import short_location

log = logging.getLogger("cgcompile")

_COLUMNS = ("id", "kind", "tags", "module", "ops", "first reason")


def describe_config(config) -> str:
    modules = ", ".join(str(getattr(m, "value", m)) for m in config.cuda_graph_modules) or "whole layer"
    return (f"cuda_graph_impl={config.cuda_graph_impl.value}, cuda_graph_modules=[{modules}], "
            f"inference_cuda_graph_scope={config.inference_cuda_graph_scope.value}, "
            f"warmup={config.cuda_graph_warmup_steps}, driver={config.driver.value}"
            + (f", dynamic_padding={config.dynamic_padding.value}" if config.dynamic_padding.value != "off" else ""))


def execution_note(graph: GraphPlan, config) -> str:
    """Why this plan will or will not really capture on this run (CPU runs say what would be captured)."""
    driver = config.driver.value
    if driver == "eager":
        return "driver=eager: nothing is captured (capture marks what would be)"
    if driver == "emulate":
        return "driver=emulate: capture is emulated on the CPU"
    if graph.device != "cuda" and driver == "auto":
        return f"runs eagerly: tensors are on {graph.device} (capture marks what would be captured on a GPU)"
    return f"captured with driver={driver} on {graph.device}"


def summary_line(graph: GraphPlan, config) -> str:
    captured = graph.captured
    total_ops = sum(p.num_ops for p in graph.partitions)
    captured_ops = sum(p.num_ops for p in captured)
    mode = "training" if graph.training else "inference"
    return (f"graph {graph.index} ({mode}, {graph.scope} scope): {len(graph.partitions)} partitions, "
            f"{len(captured)} captured, {len(graph.partitions) - len(captured)} eager; "
            f"{captured_ops}/{total_ops} ops captured; {execution_note(graph, config)}")


def padding_text(padding) -> str:
    """'padded max: 4 producers, <= 16 rows' (the plan's padding summary, one line)."""
    count = padding["producers"]
    what = f"{count} producer{'s' if count > 1 else ''}, <= {max(padding['rows'])} rows"
    if padding["mode"] == "buckets":
        buckets = ",".join(map(str, padding["buckets"])) or "powers of two"
        what += f", buckets {buckets}"
    return f"padded {padding['mode']}: {what}"


def _first_reason(partition) -> str:
    if partition.captured and partition.padding:
        return padding_text(partition.padding)
    if not partition.reasons:
        return "-"
    r = partition.reasons[0]
    return f"{r.category}: {r.op} at {short_location(r.location)}"


def format_table(graph: GraphPlan) -> str:
    rows = [_COLUMNS] + [
        (str(p.id), p.kind, "+".join(p.tags) or "-", p.module or "-", str(p.num_ops), _first_reason(p))
        for p in graph.partitions]
    return "\n".join(_aligned(rows, right=(0, 4)))


def _aligned(rows: List[tuple], right: tuple = ()) -> List[str]:
    """Rows as columns padded to the widest cell (the last column unpadded); `right`: right-aligned columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [row[i].rjust(widths[i]) if i in right else row[i].ljust(widths[i]) for i in range(len(widths))]
        lines.append(("  ".join(cells) + "  " + row[-1]).rstrip())
    return lines


def format_redistributions(graph: GraphPlan) -> str:
    """The collectives of the graph's DTensor redistributions, one row each, with the partition that runs them
    ('' when there are none): tensor parallelism's communication, and whether it is captured."""
    rows = [(str(p.id), p.kind, f"{r.collective} over {r.mesh_dim}", f"{r.source} -> {r.target}", r.module or "-",
             short_location(r.location)) for p in graph.partitions for r in p.redistributions]
    if not rows:
        return ""
    header = ("DTensor redistributions (their collectives run in the partition's forward graph, the gradients' "
              "in its backward graph):")
    return "\n".join([header] + _aligned([_REDISTRIBUTION_COLUMNS] + rows, right=(0,)))


_REDISTRIBUTION_COLUMNS = ("id", "kind", "collective", "placements", "module", "at")


def capture_sizes_line(graph: GraphPlan, config) -> str:
    """What capture_sizes does to this graph ('' when the option is off or the batch is static)."""
    sizes = ", ".join(map(str, config.capture_sizes))
    if graph.static_batch_of_one:
        return (f"capture_sizes [{sizes}]: not applied: this frame has a static batch of 1 (Dynamo traces sizes 0 "
                f"and 1 as frames of their own), so it captures graphs of its own; to serve a batch of 1 from the "
                f"smallest size, pad it to {min(config.capture_sizes)} rows before the call "
                f"(docs/guides/serving.md)")
    if graph.batch_symbol is None:
        return ""
    refused = graph.batch_padding_refused
    if refused is None:
        return (f"capture_sizes [{sizes}]: batch {graph.batch_symbol} is padded to the next size, outputs sliced "
                f"back; larger batches run eagerly")
    return (f"capture_sizes [{sizes}]: not applied, one graph per batch size: {refused.category}: {refused.op} at "
            f"{short_location(refused.location)}: {refused.detail}" + (f" ({refused.hint})" if refused.hint else ""))


def format_plan(plan) -> str:
    """The table `str(cgcompile.Plan)` prints: config line, then per graph its summary and partitions, then
    Dynamo's graph breaks. `plan` is read through its fields (config, graphs, graph_breaks)."""
    lines: List[str] = [f"cgcompile plan: {describe_config(plan.config)}"]
    migrations = getattr(plan.config, "migrations", ())
    if migrations:
        lines.append(f"options rewritten: {'; '.join(map(str, migrations))}")
    for graph in plan.graphs:
        lines.append(summary_line(graph, plan.config))
        lines.append(format_table(graph))
        if format_redistributions(graph):
            lines.append(format_redistributions(graph))
        if capture_sizes_line(graph, plan.config):
            lines.append(capture_sizes_line(graph, plan.config))
    if plan.graph_breaks:
        lines.append(f"Dynamo graph breaks ({len(plan.graph_breaks)}), each runs in Python between graphs:")
        for brk in plan.graph_breaks:
            reason = brk.reason.strip().splitlines()[0] if brk.reason.strip() else "?"
            lines.append(f"  {short_location(brk.location)}: {reason}")
            if brk.hint:
                lines.append(f"    fix: {brk.hint}")
    if not plan.graphs and not plan.graph_breaks:
        lines.append("no graphs were compiled")
    lines.extend(measured_lines(getattr(plan, "measured", {})))
    return "\n".join(lines)


def measured_lines(measured: dict) -> List[str]:
    """What runs so far measured per partition (option measure_benefit; stats()["benefit"]), one line each."""
    if not measured:
        return []
    lines = ["measured (eager vs replay per call, saving per call and per step):"]
    for name, row in sorted(measured.items()):
        verdict = "captured" if row["profitable"] else "eager: not_profitable"
        lines.append(f"  {name}: eager {row['eager_ms']:.3f} ms, replay {row['replay_ms']:.3f} ms, saving "
                     f"{row['saving_ms']:.3f} ms per call, {row['saving_per_step_ms']:.3f} ms per step: {verdict}")
    return lines



def log_graph_plan(graph: GraphPlan, config) -> None:
    """INFO: summary and table; DEBUG: every finding of every node (not only the first per partition)."""
    if log.isEnabledFor(logging.INFO):
        redistributions = format_redistributions(graph)
        log.info("%s\n%s%s", summary_line(graph, config), format_table(graph),
                 f"\n{redistributions}" if redistributions else "")
    if graph.batch_padding_refused is not None:
        log.warning("cgcompile: graph %d: %s", graph.index, capture_sizes_line(graph, config))
    elif graph.static_batch_of_one:
        log.info("cgcompile: graph %d: %s", graph.index, capture_sizes_line(graph, config))
    if log.isEnabledFor(logging.DEBUG):
        for node, findings in graph.findings.items():
            for f in findings:
                log.debug("graph %d node %s: %s %s at %s in %s: %s%s", graph.index, node, f.category, f.op,
                          f.location or "?", f.module or "<root>", f.detail or "",
                          f"; hint: {f.hint}" if f.hint else "")


def full_iteration_error(graph: GraphPlan) -> str:
    """The one error full_iteration raises when the frame cannot be a single graph: every blocking op, with
    its file:line and fix hint (Megatron's "no sync in the step" rule, derived from the graph). Ops that are
    blocked only because they consume a data-dependent size are counted, not listed: fixing the cause fixes them."""
    unique = {}
    for p in graph.partitions:
        if not p.captured:
            for r in p.reasons:
                unique.setdefault((r.category, r.op, r.location), r)
    causes = [r for r in unique.values() if not r.downstream]
    downstream = len(unique) - len(causes)
    lines = [f"cuda_graph_impl='full_iteration' needs the whole step in one graph, but graph {graph.index} has "
             f"{len(causes)} op(s) that cannot be captured:"]
    for r in causes:
        where = f" in {r.module}" if r.module else ""
        # category and op first: a reader (or a tool) that cuts the line keeps the reason, whatever the path
        lines.append(f"  {r.category} {r.op} at {r.location or '?'}{where}" + (f" -- {r.hint}" if r.hint else ""))
    if downstream:
        lines.append(f"  (and {downstream} op(s) whose shapes depend on their results)")
    lines.append("Fix them, or use cuda_graph_impl='local' to capture around them.")
    return "\n".join(lines)

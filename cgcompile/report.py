"""`cgcompile.report(path)`: the run as one static HTML page, next to the plan's picture (visual.py).

The plan says what would be captured; the run says what was: per compiled frame (one runtime each), per
partition its kind, captured or eager and why (the plan's reason, or the runtime's: a fallback such as
`not_profitable` or `memory_budget`), graphs and input sizes, reuse, bytes held, eager vs replay time and the
saving, then totals per step. It reads what stats() reads (the live runtimes' partition rows and graphs, the
counters) and never recomputes a number, so the page and stats() agree. Inline CSS, no script, no network.
"""

from __future__ import annotations

import html
import os
from typing import Any, Dict, List, Optional

from .diagnostics import describe_config
from .runtime.release import held_bytes, holders
from .stats import stats
from .visual import finish_page

__all__ = ["report"]

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin-top: 1.4em; }
.config, .totals { font-family: ui-monospace, monospace; font-size: 12px; color: #444; }
table { border-collapse: collapse; font-size: 12px; }
td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-family: ui-monospace, monospace; }
tr.captured td.status { color: #2e7d32; } tr.eager td.status { color: #e65100; }
"""

COLUMNS = ("partition", "kind", "status", "why", "graphs", "sizes", "calls", "replays", "reuse", "graph_bytes",
           "eager_ms", "replay_ms", "saving_ms", "saving_per_step_ms")


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else html.escape(str(value))


def _kind(runtime: Any, name: str) -> str:
    """training (forward and backward graphs) or inference: the frame's plan says, else the graphs captured."""
    if runtime.plan is not None:
        return "training" if runtime.plan.training else "inference"
    kinds = {g.kind for g in runtime.live_graphs() if g.partition == name}
    return "training" if kinds & {"forward", "backward"} else "inference" if kinds else "-"


def partition_rows(runtime: Any) -> List[Dict[str, Any]]:
    """One row per partition of the frame: its plan's eager islands, and each captured partition with the
    numbers of its stats()["partitions"] row (runtime.partition_stats(), what stats() reads)."""
    rows = {row["partition"]: row for row in runtime.partition_stats()}
    graphs = runtime.graph_memory()
    out: List[Dict[str, Any]] = []
    plan = runtime.plan
    names = list(rows)
    for p in (plan.partitions if plan is not None else ()):
        if p.captured:
            continue
        first = p.reasons[0] if p.reasons else None
        why = f"{first.category}: {first.op} at {first.location or '?'}" if first is not None else "-"
        out.append({"partition": f"graph {plan.index} partition {p.id}", "kind": "eager island", "status": "eager",
                    "why": why, "order": p.id})
    for name in names:
        row = rows[name]
        fallback = row.get("fallback")
        status = "eager" if fallback else "captured"
        why = fallback or (f"stopped capturing new sizes: {row['stopped']}" if row["stopped"] else "")
        number = name.rsplit("submod_", 1)[-1]
        out.append({**row, "kind": _kind(runtime, name), "status": status, "why": why,
                    "graphs": sum(1 for g in graphs if g["partition"] == name),
                    "order": int(number) if number.isdigit() else 0})
    return sorted(out, key=lambda row: row["order"])


def _table(rows: List[Dict[str, Any]]) -> str:
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    body = []
    for row in rows:
        cells = []
        for column in COLUMNS:
            value = row.get(column)
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            cells.append(f'<td class="{"num" if numeric else column}" data-col="{column}">{_cell(value)}</td>')
        body.append(f'<tr class="{row["status"]}" data-partition="{html.escape(row["partition"])}">'
                    + "".join(cells) + "</tr>")
    return f"<table>\n<tr>{head}</tr>\n" + "\n".join(body) + "\n</table>"


def _totals(rows: List[Dict[str, Any]], nbytes: int) -> Dict[str, Any]:
    saving = [row["saving_per_step_ms"] for row in rows
              if row.get("saving_per_step_ms") is not None and row["status"] == "captured"]  # what still pays
    return {"captured": sum(row["status"] == "captured" for row in rows if "calls" in row),
            "eager": sum(row["status"] == "eager" for row in rows), "graph_bytes": nbytes,
            "saving_per_step_ms": round(sum(saving), 4) if saving else None}


def _totals_html(totals: Dict[str, Any], label: str) -> str:
    return (f'<p class="totals" data-scope="{label}">' + ", ".join(
        f'{key}: <span data-total="{key}">{_cell(value)}</span>' for key, value in totals.items()) + "</p>")


def report(path: Optional[str | os.PathLike] = None) -> str:
    """Render the run so far as one self-contained HTML page (and write it to `path` when given): per compiled
    frame, per partition its kind, captured or eager and why, graphs, sizes, reuse, bytes held, eager vs replay
    time and saving per call and per step (with option measure_benefit), and totals per step. Returns the HTML."""
    snapshot = stats()
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>cgcompile run report</title>',
             f"<style>{_CSS}</style></head><body>", "<h1>cgcompile run report</h1>"]
    runtimes = [h for h in holders() if hasattr(h, "partition_stats") and hasattr(h, "plan")]
    for number, runtime in enumerate(runtimes):
        rows = partition_rows(runtime)
        frame = next((row["frame"] for row in rows if "frame" in row), "-")
        parts.append(f'<section class="runtime" data-runtime="{number}"><h2>frame {number}: {_cell(frame)} '
                     f'(driver {_cell(runtime.driver.name)})</h2>')
        parts.append(f'<div class="config">{_cell(describe_config(runtime.config))}</div>')
        parts.append(_table(rows))
        parts.append(_totals_html(_totals(rows, held_bytes(runtime.graph_memory())), f"runtime {number}"))
        parts.append("</section>")
    if not runtimes:
        parts.append("<p>no compiled frame has captured partitions</p>")
    totals = {"graphs_captured": snapshot["graphs_captured"], "graph_bytes": snapshot["graph_bytes"],
              "steady_replays": snapshot["steady_replays"], "reuse": snapshot["reuse"],
              "eager_fallbacks": len(snapshot["eager_fallbacks"])}
    parts.append("<h2>All frames</h2>" + _totals_html(totals, "all"))
    fallbacks = "".join(f"<li>{_cell(f['partition'])}: {_cell(f['reason'])}</li>" for f in snapshot["eager_fallbacks"])
    parts.append(f"<ul class=\"fallbacks\">{fallbacks}</ul>" if fallbacks else "")
    return finish_page(parts, path)

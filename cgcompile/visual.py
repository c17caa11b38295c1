"""Plan -> one self-contained HTML page: each Dynamo graph drawn as a strip of partitions.

The table from `str(plan)` says what happens; the strip shows *where* capture stops at a glance: captured and
eager partitions in different colours, widths proportional to op count (a minimum width keeps one-op islands
visible), and a hover text per partition with its tags, module and every reason. Inline CSS only (no scripts,
no network), so the file can be attached to a bug report or opened offline. Reads the Plan; never recomputes it.
"""

from __future__ import annotations

import html
import os
from typing import List, Optional

from .diagnostics import describe_config, padding_text, summary_line
from .plan import GraphPlan, Partition

CAPTURED_COLOUR = "#2e7d32"
EAGER_COLOUR = "#e65100"
MIN_WIDTH_PX = 6

_CSS = f"""
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.3em; margin: 0 0 .3em; }}
h2 {{ font-size: 1.05em; margin: 1.4em 0 .3em; }}
.config, .summary {{ font-family: ui-monospace, monospace; font-size: 12px; color: #444; }}
.legend span {{ display: inline-block; margin-right: 1.2em; }}
.swatch {{ display: inline-block; width: 1em; height: 1em; vertical-align: -2px; margin-right: .3em; }}
.strip {{ display: flex; width: 100%; height: 2.2em; border: 1px solid #999; }}
.partition {{ flex-shrink: 1; flex-basis: 0; min-width: {MIN_WIDTH_PX}px; box-sizing: border-box;
  border-right: 1px solid #fff; color: #fff; font-size: 11px; overflow: hidden; white-space: nowrap;
  text-overflow: ellipsis; padding: .55em .25em 0; cursor: help; }}
.capture {{ background: {CAPTURED_COLOUR}; }}
.eager {{ background: {EAGER_COLOUR}; }}
.partition:hover {{ filter: brightness(1.2); }}
table {{ border-collapse: collapse; margin-top: .5em; font-size: 12px; }}
td, th {{ border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }}
td.reasons {{ font-family: ui-monospace, monospace; }}
"""


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def reason_text(reason) -> str:
    """One line per reason: category, op, file:line and the fix hint (full path: this is the detailed view)."""
    text = f"{reason.category}: {reason.op} at {reason.location or '?'}"
    if reason.detail:
        text += f" ({reason.detail})"
    if reason.hint:
        text += f"; hint: {reason.hint}"
    return text


def partition_title(p: Partition) -> str:
    """The hover text: everything the plan knows about one partition, one fact per line."""
    lines = [f"partition {p.id}: {p.kind}", f"tags: {', '.join(p.tags) or '-'}", f"module: {p.module or '-'}",
             f"ops: {p.num_ops}"]
    if p.padding:
        lines.append(padding_text(p.padding))
    if p.reasons:
        lines.append("reasons:")
        lines.extend(f"  {reason_text(r)}" for r in p.reasons)
    return "\n".join(lines)


def _label(p: Partition) -> str:
    return f"#{p.id} {'+'.join(p.tags) or p.module or ''}".strip()


def _graph_html(graph: GraphPlan, config) -> str:
    cells = []
    for p in graph.partitions:
        # flex-grow = op count with a zero basis: widths proportional to ops, min-width keeps tiny islands visible.
        cells.append(f'<div class="partition {_esc(p.kind)}" data-id="{p.id}" data-kind="{_esc(p.kind)}" '
                     f'data-ops="{p.num_ops}" style="flex-grow: {p.num_ops}" title="{_esc(partition_title(p))}">'
                     f'{_esc(_label(p))}</div>')
    rows = []
    for p in graph.partitions:
        reasons = "<br>".join(_esc(reason_text(r)) for r in p.reasons) or "-"
        rows.append(f"<tr><td>{p.id}</td><td>{_esc(p.kind)}</td><td>{_esc('+'.join(p.tags) or '-')}</td>"
                    f"<td>{_esc(p.module or '-')}</td><td>{p.num_ops}</td><td class=\"reasons\">{reasons}</td></tr>")
    return (f'<section class="graph" data-index="{graph.index}">\n<h2>graph {graph.index}</h2>\n'
            f'<div class="summary">{_esc(summary_line(graph, config))}</div>\n'
            '<div class="strip">\n' + "\n".join(cells) + "\n</div>\n"
            "<details><summary>partitions and reasons</summary><table>\n"
            "<tr><th>id</th><th>kind</th><th>tags</th><th>module</th><th>ops</th><th>reasons</th></tr>\n"
            + "\n".join(rows) + "\n</table></details>\n</section>")


def _breaks_html(plan) -> str:
    if not plan.graph_breaks:
        return '<h2>Dynamo graph breaks</h2>\n<p class="breaks">none</p>'
    items = []
    for brk in plan.graph_breaks:
        first = brk.reason.strip().splitlines()[0] if brk.reason.strip() else "?"
        items.append(f'<li title="{_esc(brk.reason)}"><code>{_esc(brk.location or "?")}</code>: {_esc(first)}</li>')
    return (f"<h2>Dynamo graph breaks ({len(plan.graph_breaks)})</h2>\n"
            f"<p>Each runs in Python between graphs.</p>\n<ul class=\"breaks\">\n" + "\n".join(items) + "\n</ul>")


def plan_to_html(plan, path: Optional[str | os.PathLike] = None) -> str:
    """Render `plan` as a self-contained HTML page; also write it to `path` when given. Returns the HTML."""
    migrations = getattr(plan.config, "migrations", ())
    parts: List[str] = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>cgcompile plan</title>',
        f"<style>{_CSS}</style></head><body>", "<h1>cgcompile plan</h1>",
        f'<div class="config">{_esc(describe_config(plan.config))}</div>',
    ]
    if migrations:
        parts.append(f'<div class="config">migrated: {_esc("; ".join(str(m) for m in migrations))}</div>')
    parts.append(f'<p class="legend"><span><i class="swatch capture"></i>captured (replayed as CUDA graphs)'
                 f'</span><span><i class="swatch eager"></i>eager (hover for the reason)</span>'
                 f"<span>width: op count (min {MIN_WIDTH_PX}px)</span></p>")
    parts.extend(_graph_html(graph, plan.config) for graph in plan.graphs)
    if not plan.graphs:
        parts.append("<p>no graphs were compiled</p>")
    parts.append(_breaks_html(plan))
    return finish_page(parts, path)


def finish_page(parts: List[str], path: Optional[str | os.PathLike]) -> str:
    """Close a page begun in `parts`, write it to `path` when given; the HTML (the plan's and report.py's)."""
    parts.append("</body></html>\n")
    text = "\n".join(parts)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text

"""bench_cpu table (g), reuse: the loops of issue 27, each through the real backend with the emulate driver:
captures, live graphs and the share of calls after the capture step that replayed a graph captured earlier."""

from __future__ import annotations

from typing import Callable, List, Tuple

import torch
import torch.nn as nn
from replay_cost import BreakBlock

import cgcompile

__all__ = ["reuse_rows"]


def _loop(model: nn.Module, batches: Callable[[int], torch.Tensor], steps: int, options: dict,
          keep_loss: bool = True, dynamic: bool = False) -> dict:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="cudagraph_modules", dynamic=dynamic or None,
                             options={"driver": "emulate", **options})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cgcompile.reset_stats()
    marks = []
    loss = None
    for step in range(steps):
        opt.zero_grad()
        loss = compiled(batches(step)).square().mean()
        loss.backward()
        opt.step()
        if not keep_loss:
            loss = None
        rows = cgcompile.stats()["partitions"]
        marks.append((sum(r["calls"] - r["warmup_calls"] for r in rows), sum(r["replays"] for r in rows)))
    st = cgcompile.stats()
    graphs = st["graphs"]
    first = next((i for i, (calls, _) in enumerate(marks) if calls), 0)  # the capture step
    (calls_0, replays_0), (calls_1, replays_1) = marks[first], marks[-1]
    reuse = (replays_1 - replays_0) / (calls_1 - calls_0) if calls_1 > calls_0 else 0.0
    return {"captured": st["graphs_captured"], "live": len(graphs), "released": st["graphs_released"],
            "stops": len(st["bank_stops"]), "fallbacks": len(st["eager_fallbacks"]), "reuse": reuse,
            "all_replayed": bool(graphs) and all(g["steady_replays"] > 0 for g in graphs)}


def reuse_rows(quick: bool) -> List[Tuple[str, dict, str, bool]]:
    """The loops of issue 27 and what the graph bank did with them: (name, counts, goal, met)."""
    from tests.test_reuse import IslandModel

    rows = []
    steps = 6 if quick else 10
    for keep in (True, False):
        torch.manual_seed(0)
        rows.append(_steady_goal(f"island context keeps an output, loss {'kept' if keep else 'deleted'}",
                                 _loop(IslandModel(),
                                       lambda s: torch.randn(8, 16, generator=torch.Generator().manual_seed(s)),
                                       steps, {"cuda_graph_warmup_steps": 1}, keep_loss=keep)))
    for layers in ((8, 16) if quick else (8, 16, 48)):
        torch.manual_seed(0)
        x = torch.randn(8, 32)
        rows.append(_steady_goal(f"a break per layer, {layers} layers, fixed shapes",
                                 _loop(nn.Sequential(*[BreakBlock() for _ in range(layers)]), lambda s: x, steps, {})))
    torch.manual_seed(0)
    sizes = [2, 3, 4, 5] * 5
    row = _loop(nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6)), lambda s: torch.randn(sizes[s], 6),
                len(sizes), {"cuda_graph_warmup_steps": 1, "max_graphs_per_partition": 2}, dynamic=True)
    rows.append(("max_graphs_per_partition=2, batch sizes cycling 2..5", row,
                 "2 sizes captured (forward + backward), each graph replayed, no stop",
                 row["captured"] == row["live"] == 4 and row["all_replayed"] and not row["stops"]))
    row = _declared_sizes()
    rows.append(("capture_sizes=[2, 4, 8], batches 1..8 (inference)", row, "exactly 3 captures",
                 row["captured"] == 3 and not row["released"]))
    for schedule in (("1f1b",) if quick else ("gpipe", "1f1b")):
        row = _schedule(schedule)
        rows.append((f"{schedule} schedule, {row['micro_batches']} micro-batches, dense_gpt 2 layers", row,
                     f"each of the {row['per_step']} graph calls a step replayed at the last 3 steps (replays: "
                     f"{row['late_replays']}), a live graph per graph needed",
                     row["late_replays"] == [row["per_step"]] * 3 and row["live"] == row["per_step"]))
    return rows


def _schedule(schedule: str) -> dict:
    """A pipeline schedule's micro-batches through one compiled model (tests/test_microbatch_schedules.py, which
    checks every step against eager): captures, live graphs, the replays of each of the last steps."""
    from tests.test_microbatch_schedules import SCHEDULES, replays_per_step, run_schedule

    torch._dynamo.reset()
    cgcompile.reset_stats()
    steady = run_schedule(schedule)
    st = cgcompile.stats()
    return {"captured": st["graphs_captured"], "live": len(st["graphs"]), "released": st["graphs_released"],
            "stops": len(st["bank_stops"]), "fallbacks": len(st["eager_fallbacks"]), "reuse": st["reuse"],
            "micro_batches": len(SCHEDULES[schedule].split()) // 2, "per_step": replays_per_step(schedule),
            "late_replays": [b - a for a, b in zip(steady[-4:], steady[-3:])]}


def _steady_goal(name: str, row: dict) -> Tuple[str, dict, str, bool]:
    met = (row["captured"] == row["live"] and not row["released"] and not row["stops"] and not row["fallbacks"]
           and row["reuse"] >= 0.95)
    return name, row, "captured == live, nothing released, stopped or eager, reuse >= 0.95", met


def _declared_sizes() -> dict:
    from tests.test_reuse import DECLARED_SIZES_BATCHES, declared_sizes_model

    torch._dynamo.reset()
    _, compiled = declared_sizes_model()
    cgcompile.reset_stats()
    with torch.no_grad():
        for batch in DECLARED_SIZES_BATCHES:
            compiled(torch.randn(batch, 8))
    st = cgcompile.stats()
    return {"captured": st["graphs_captured"], "live": len(st["graphs"]), "released": st["graphs_released"],
            "stops": len(st["bank_stops"]), "fallbacks": len(st["eager_fallbacks"]), "reuse": st["reuse"]}

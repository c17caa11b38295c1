"""bench_cpu table (e): the graph bank on a 2-layer MoE training step with new tokens every step (emulate driver):
live graphs, the bytes they hold between steps against the bytes the graphs of one step use, replays per call,
the hit rate of the partitions still capturing, releases and stops, for dynamic_padding off / buckets / max.

Run through bench_cpu.py (`python benchmarks/bench_cpu.py`; `--quick` for a short run).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.models

import torch  # noqa: E402

import cgcompile  # noqa: E402
from goals import within  # noqa: E402
from tests.models import MODELS  # noqa: E402

SPEC = MODELS["moe_mask"]
OURS = "cudagraph_modules"


BANK_BATCH, BANK_GOALS = (8, 64), {"held_vs_step": 1.5, "drift": 0.10, "kept_hit_rate": 0.80}
BANK_SIZES_REPEAT = (3, 32)  # 96 tokens: the expert loop's bucket is 64 or 96 (two sizes that keep coming back)


def bench_bank(mode: str, steps: int, checkpoints=(10, 40), tokens=BANK_BATCH) -> dict:
    """(e) the graph bank on a 2-layer MoE training step with new tokens every step (512 a step), default options
    (driver=emulate): per checkpoint step, live graphs, bytes they hold between steps (stats()["graph_bytes"]:
    output arenas once) and bytes the graphs that step used need (their own, and what their outputs take of an
    arena); over the last 10 steps, replays per partition call and the hit rate of the partitions still
    capturing; releases and stops. Also at the last step: what the live graphs would hold with their outputs
    each in memory of their own (no arenas)."""
    torch._dynamo.reset()
    model = SPEC.make(num_layers=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    options = {"driver": "emulate", **({"dynamic_padding": mode} if mode != "off" else {})}
    flags = {"capture_dynamic_output_shape_ops": mode != "off"}  # "off": Dynamo's defaults (nonzero breaks)
    size = lambda g: (g["static_input_bytes"] + g["static_output_bytes"] + g["pool_bytes"]  # noqa: E731
                      + g["arena_output_bytes"])
    found, seen, calls = {}, {}, {}
    with torch._dynamo.config.patch(**flags):
        run = torch.compile(model, backend=OURS, options=options)
        cgcompile.reset_stats()
        for i in range(steps):
            (batch,) = SPEC.example_inputs(batch=tokens[0], seq=tokens[1], seed=1000 + i)
            SPEC.loss(run, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stats = cgcompile.stats()
            graphs = {g["label"]: g for g in stats["graphs"]}  # labels are unique: checked against the rows below
            used = [g for label, g in graphs.items() if g["replays"] != seen.get(label)]
            seen = {label: g["replays"] for label, g in graphs.items()}
            if i + 1 in checkpoints:
                found[i + 1] = (len(graphs), stats["graph_bytes"], sum(map(size, used)))
            if i + 1 == steps - 10:
                calls = {p["partition"]: p for p in stats["partitions"]}
    parts = stats["partitions"]
    delta = lambda p, k: p[k] - calls.get(p["partition"], {}).get(k, 0)  # noqa: E731
    total = sum(delta(p, "calls") for p in parts)
    kept = [p for p in parts if not p["stopped"]]
    kept_calls = sum(delta(p, "calls") for p in kept)
    return {"checkpoints": found, "replays_per_call": sum(delta(p, "replays") for p in parts) / max(total, 1),
            "kept_hit_rate": sum(delta(p, "replays") for p in kept) / max(kept_calls, 1),
            "released": stats["graphs_released"], "stops": len(stats["bank_stops"]),
            "captured": stats["graphs_captured"], "labels_unique": len(stats["graphs"]) == len(seen),
            "unshared": sum(map(size, stats["graphs"]))}


def print_bank(steps: int) -> None:
    """Table (e): bench_bank for off / buckets / max at BANK_BATCH and for sizes that repeat, judged."""
    workloads = [(mode, BANK_BATCH) for mode in ("off", "buckets", "max")] + [("buckets", BANK_SIZES_REPEAT)]
    results = {(mode, tokens): bench_bank(mode, steps, (10, steps), tokens) for mode, tokens in workloads}
    first, last = 10, steps
    print(f"\ngraph bank (e): 2-layer MoE training step, new tokens every step, {steps} steps, default options, "
          f"driver=emulate; held: graph_bytes (each output arena once); own outputs: the same graphs without arenas")
    print(f"mode      tokens   live graphs {first}/{last}  held MiB {first}/{last}  own outputs MiB  step's graphs MiB"
          f"  held/step  replays/call  kept hit rate  captured  released  stops  result")
    for (mode, tokens), r in results.items():
        (live_a, held_a, _), (live_b, held_b, used_b) = r["checkpoints"][first], r["checkpoints"][last]
        ratio, drift = held_b / max(used_b, 1), abs(held_b - held_a) / max(held_a, 1)
        ok = (within(ratio, BANK_GOALS["held_vs_step"]) and drift <= BANK_GOALS["drift"]
              and r["kept_hit_rate"] >= BANK_GOALS["kept_hit_rate"] and r["labels_unique"])
        verdict = ("PASS" if ok else "MISS") if tokens == BANK_BATCH else "-"  # the goals are for BANK_BATCH
        print(f"{mode:<8}  {tokens[0]}x{tokens[1]:<5}  {live_a:>8}/{live_b:<6}"
              f"  {held_a / 2**20:>6.2f}/{held_b / 2**20:<6.2f}  {r['unshared'] / 2**20:>15.2f}  {used_b / 2**20:>17.2f}"
              f"  {ratio:>8.2f}x  {r['replays_per_call']:>12.2f}  {r['kept_hit_rate']:>13.2f}  {r['captured']:>8}"
              f"  {r['released']:>8}  {r['stops']:>5}  {verdict}")
    print(f"goals (tokens {BANK_BATCH[0]}x{BANK_BATCH[1]}): held <= {BANK_GOALS['held_vs_step']}x the step's graphs, "
          f"step {last} within {BANK_GOALS['drift']:.0%} of step {first}, kept hit rate >= "
          f"{BANK_GOALS['kept_hit_rate']:.0%}, unique labels; {BANK_SIZES_REPEAT[0]}x{BANK_SIZES_REPEAT[1]}: sizes "
          f"that repeat, held vs own outputs")

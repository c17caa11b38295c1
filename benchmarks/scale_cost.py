"""Host-side cost at depth: a 48-layer vs a 12-layer MoE (64 experts per layer, small hidden size), compiled with
cgcompile on the emulate driver (the CPU stand-in for capture and replay), training steps.

Per model, from one compile (fresh Dynamo state):
  planning  time inside cgcompile's planner (cgcompile.planner.plan_graph, every frame and graph)
  capture   time inside the driver's capture calls (EmulateDriver.capture, forward and backward graphs)
  step      median host time of a steady training step (every partition replaying), after capture, with each
            emulated replay made a no-op returning its static outputs (replay_cost.replays_as_launches): on a GPU
            a replay is one launch, so what grows with depth here is the host's work around the replays; the
            same steps with the emulator computing every replay's kernels on the CPU are a diagnosis row (their
            kernels' time also grows with the model's memory, 4x the weights no longer in the CPU's caches)
Goal (issue 37): each grows linearly with layers: 48 vs 12 layers <= 4.4x. Times are this process's CPU time
(time.process_time, one torch thread): on a small shared machine, wall time also counts the other processes.

Each layer: RMS-style norm, a linear mixer, a top-8 router over 64 experts, the experts as two 3-D weights
computed for every token (grouped, no data-dependent shape: the host cost under test is per graph node and per
parameter, not per FLOP) and combined with the routing weights. The judged capture step starts with the compile's
garbage collected (gc.collect() after the warmup steps, the collector on during the capture): a compile leaves
hundreds of thousands of new long-lived objects, and the full collection they make due lands in whichever step
allocates next (at 48 layers, the capture step; at 12, a later one), a cost of the compile's heap, not of the
capture. Also reported: the collector's passes during capture (per generation and their time, from gc.callbacks),
and as diagnosis the capture with nothing collected first and with the collector off (gc.disable()).

    python benchmarks/scale_cost.py              # 12 vs 48 layers, 3 repeats (about 2 minutes on 2 cores)
    python benchmarks/scale_cost.py --quick      # 3 vs 12 layers, 1 repeat
    python benchmarks/scale_cost.py --profile    # also cProfile the 48-layer capture (top functions)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time
from typing import Dict, Iterator, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import cgcompile  # noqa: E402,F401
import cgcompile.frame_plan as cg_frame_plan  # noqa: E402  # the backend looks plan_graph up there
from cgcompile.runtime.drivers.emulate import EmulateDriver  # noqa: E402
from goals import judged  # noqa: E402
from replay_cost import replays_as_launches  # noqa: E402

EXPERTS, TOP_K, HIDDEN, WIDTH, TOKENS = 64, 8, 32, 16, 32
GOAL = 4.4  # 48 vs 12 layers (4x the layers)
CLOCK = time.process_time  # this process's CPU time: a shared, busy machine's other processes do not count
WARMUP = 3  # cgcompile's default cuda_graph_warmup_steps: the next step captures
COLLECTOR = {"gc on": "collected", "gc pending": "pending", "gc off": "off"}  # run()'s modes -> measure(collector=)


class Layer(nn.Module):
    def __init__(self, d: int = HIDDEN, experts: int = EXPERTS, width: int = WIDTH, top_k: int = TOP_K):
        super().__init__()
        self.top_k = top_k
        self.norm = nn.Parameter(torch.ones(d))
        self.mixer = nn.Linear(d, d)
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d, width) * d ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, width, d) * width ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        x = x + self.mixer(h)
        probs = self.router(x).softmax(-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))  # (T, E)
        inner = torch.relu(torch.einsum("td,edw->etw", x, self.w_in))
        out = torch.einsum("etw,ewd->etd", inner, self.w_out)
        return x + torch.einsum("te,etd->td", gates, out)


def build(layers: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[Layer() for _ in range(layers)])


@contextlib.contextmanager
def timed(owner, name: str, total: List[float]) -> Iterator[None]:
    """Add the wall time of every call of owner.name (a function or method) to total[0] while inside."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = CLOCK()
        try:
            return original(*args, **kwargs)
        finally:
            total[0] += CLOCK() - start

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


class GcWatch:
    """Collections per generation and their total time, from gc.callbacks, while inside."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = CLOCK()
        else:
            self.count[info["generation"]] += 1
            self.seconds += CLOCK() - self._start

    def __enter__(self) -> "GcWatch":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def measure(layers: int, steps: int = 8, collector: str = "collected",
            profile_capture: bool = False) -> Dict[str, object]:
    """One fresh compile of a `layers`-deep model: planning, capture and steady step seconds, gc during capture.
    `collector` during the capture step: "collected" (the garbage left by the compile and warmup collected before
    it, the collector on: the capture step pays for its own objects), "pending" (on, nothing collected first:
    a full pass the compile's objects make due may land in it) or "off" (gc.disable())."""
    torch._dynamo.reset()
    gc.collect()
    cgcompile.reset_stats()
    model = build(layers)
    compiled = torch.compile(model, backend="cudagraph_modules", options={"driver": "emulate"})
    batches = [torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def step(i: int) -> None:
        compiled(batches[i % len(batches)]).sum().backward()
        model.zero_grad(set_to_none=True)

    plan, capture = [0.0], [0.0]
    prof = cProfile.Profile() if profile_capture else None
    with timed(cg_frame_plan, "plan_graph", plan), timed(EmulateDriver, "capture", capture):
        for i in range(WARMUP):
            step(i)
        if collector == "collected":
            gc.collect()
        elif collector == "off":
            gc.disable()
        try:
            with GcWatch() as watch:
                if prof:
                    prof.enable()
                step(WARMUP)  # the capture step: every forward and backward graph is captured here
                if prof:
                    prof.disable()
        finally:
            gc.enable()
        computing, launching = [], []
        for i in range(steps):  # the emulator runs every replay's kernels on the CPU (diagnosis)
            start = CLOCK()
            step(WARMUP + 1 + i)
            computing.append(CLOCK() - start)
        with replays_as_launches():  # a replay as on a GPU: one launch, the host's work around it timed
            for i in range(steps):
                start = CLOCK()
                step(WARMUP + 1 + steps + i)
                launching.append(CLOCK() - start)
    stats = cgcompile.stats()
    result = {"plan": plan[0], "capture": capture[0], "step": statistics.median(launching),
              "step_computing": statistics.median(computing),
              "graphs": stats["graphs_captured"], "gc_count": watch.count, "gc_seconds": watch.seconds,
              "replays": stats["replays"]}
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        body = out.getvalue()
        result["profile"] = body[body.find("   ncalls"):]
    torch._dynamo.reset()
    return result


def run(small: int, large: int, repeats: int) -> Dict[str, Dict[int, list]]:
    """{"gc on" | "gc pending" | "gc off": {layers: [measure(...) per repeat]}}, the two sizes interleaved
    (COLLECTOR says what each mode does in the capture step)."""
    found: Dict[str, Dict[int, list]] = {mode: {small: [], large: []} for mode in COLLECTOR}
    measure(2)  # first use pays imports and lazy init
    for r in range(repeats):
        for layers in ((small, large) if r % 2 == 0 else (large, small)):
            for mode, collector in COLLECTOR.items():
                found[mode][layers].append(measure(layers, collector=collector))
    return found


def median_of(rows: list, key: str) -> float:
    return statistics.median(row[key] for row in rows)


def table(found: Dict[str, Dict[int, list]], small: int, large: int) -> List[tuple]:
    """(metric, small, large, ratio, verdict) rows; the diagnosis rows (the collector's share, the emulator's
    kernels) have no verdict."""
    on = found["gc on"]
    rows = []
    for key, what in (("plan", "planning"), ("capture", "capture"), ("step", "per-step host time")):
        a, b = median_of(on[small], key), median_of(on[large], key)
        rows.append((what, a, b, b / a, judged(b / a, GOAL)))
    for mode, what in (("gc pending", "capture, the compile's garbage not collected first (diagnosis)"),
                       ("gc off", "capture with gc.disable() (diagnosis)")):
        if mode in found:
            a, b = median_of(found[mode][small], "capture"), median_of(found[mode][large], "capture")
            rows.append((what, a, b, b / a, "-"))
    a, b = median_of(on[small], "step_computing"), median_of(on[large], "step_computing")
    rows.append(("step, replays computing (diagnosis)", a, b, b / a, "-"))
    return rows


def print_table(found: Dict[str, Dict[int, list]], small: int, large: int) -> None:
    print(f"scale: {large} vs {small} layers, {EXPERTS} experts top-{TOP_K} per layer, hidden {HIDDEN}, expert width "
          f"{WIDTH}, {TOKENS} tokens, training step, driver=emulate; medians of {len(found['gc on'][small])} "
          f"(goal: <= {GOAL}x)")
    for what, a, b, ratio, verdict in table(found, small, large):
        print(f"  {what:<40} {small:>3} layers {a * 1e3:9.1f} ms  {large:>3} layers {b * 1e3:9.1f} ms  "
              f"{ratio:5.2f}x  {verdict}")
    for mode in ("gc on", "gc pending"):
        for layers in (small, large):
            rows = found.get(mode, {}).get(layers, [])
            if not rows:
                continue
            counts = ", ".join("/".join(map(str, row["gc_count"])) for row in rows)
            seconds = ", ".join(f"{row['gc_seconds'] * 1e3:.1f}" for row in rows)
            print(f"  capture step ({mode}), {layers} layers: {rows[0]['graphs']} graphs captured; gc collections "
                  f"during it per repeat (gen0/gen1/gen2) {counts}; {seconds} ms in gc")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 vs 12 layers, one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="cProfile the large model's capture step")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    small, large = (3, 12) if args.quick else (12, 48)
    found = run(small, large, args.repeats or (1 if args.quick else 3))
    print_table(found, small, large)
    if args.profile:
        print(f"\n--- profile: capture step, {large} layers, by own time ---")
        print(measure(large, profile_capture=True)["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

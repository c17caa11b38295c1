"""CPU benchmark of cgcompile's host-side costs, as ratios to stock torch measured in this one process.

Three questions, each answered by a median over interleaved repeats (a shared, busy host drifts; interleaving
puts the drift on both sides of a ratio):
  (a) compile: the first training step (forward + backward) after torch._dynamo.reset(), backend
      "cudagraph_modules" vs "aot_eager", on the 8-layer tiny MoE. Same Dynamo flags for both
      (capture_dynamic_output_shape_ops=True, which the mask dispatch needs to stay in one graph), with
      driver=auto (on CPU nothing is captured, so no partition is traced by aot_autograd); with --emulate also
      driver=emulate (aot_autograd per captured partition plus emulated capture: the compile work a GPU run does).
  (b) steady per-call host time vs Dynamo's "eager" backend, our options {"driver": "eager"}: a forward call
      and a training step (forward + backward), after warmup. Small inputs, so overhead is what is measured.
  (c) cgcompile.explain() at 4 vs 16 layers: should grow linearly in layers (<= 5x for 4x the layers).
  (d) dynamic_padding on a 2-layer MoE training step with new tokens every step: kernel ops still dispatched on
      the host outside graphs (the CPU proxy for launches), host reads of device data, and the matmul FLOPs the
      padding adds (the profiler's estimate), eager/off/max/buckets.
  (e) the graph bank on the same MoE with 512 new tokens a step, 40 steps, default options, off/buckets/max: live
      graphs, bytes they hold between steps against the bytes of the graphs one step uses, replays per call
      (benchmarks/bank_table.py).
  (f) a Hugging Face transformers Mixtral (benchmarks/hf_moe.py, default experts implementation,
      cuda_graph_modules=[]) training step with new tokens every step, fp32 and bf16 weights: the same counts
      as (d), vs eager. Goal: host kernel ops outside graphs <= 5% of eager's. Skipped without transformers.
  (g) host time per partition call of a real decode loop (a new position every step: the step's time over its
      bound's, shared out per call) vs a minimal wrapper, and reuse on the issue-27 loops
      (benchmarks/replay_cost.py); the whole decode step's host time vs Dynamo's floor in the same kind of loop, and
      the host time per partition call with inner_compiler="inductor" vs "eager" (issue 36).
  (j) kernels launched per step (benchmarks/kernel_count.py): cgcompile inner inductor / eager vs whole-graph
      Inductor on HF Llama / Mixtral bf16 training and a decode step, with a per-op diff. Goal <= 1.05x.
  (h) scale at depth (benchmarks/scale_cost.py): a 48-layer vs a 12-layer MoE, 64 experts per layer, small hidden
      size, driver=emulate: planning, capture and steady per-step host time. Goal: each <= 4.4x (linear in
      layers). Also capture with Python's gc disabled, for diagnosis. Left out by --quick (it takes minutes).
Torch runs on one intra-op thread: the quantities are Python-bound, and one thread is far less sensitive to
other processes on a small machine.

    python benchmarks/bench_cpu.py             # about a minute on a 2-core machine
    python benchmarks/bench_cpu.py --emulate   # also the compile cost with emulated capture
    python benchmarks/bench_cpu.py --quick     # seconds; smaller models, one repeat (CI smoke run)
    python benchmarks/bench_cpu.py --profile   # also cProfile our side of each metric, top functions
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import platform
import pstats
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # for tests.models
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for hf_moe

import torch  # noqa: E402

import cgcompile  # noqa: E402
import bank_table  # noqa: E402
from goals import judged, within  # noqa: E402
import memory_table  # noqa: E402
from tests.models import MODELS  # noqa: E402

SPEC = MODELS["moe_mask"]
OURS = "cudagraph_modules"


def _reset_model_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def first_step_seconds(model, tokens, backend: str, options=None) -> float:
    """Wall time of the first forward+backward after a Dynamo reset: tracing + backend compile + one step."""
    torch._dynamo.reset()
    kwargs = {"options": options} if options is not None else {}
    compiled = torch.compile(model, backend=backend, **kwargs)
    start = time.perf_counter()
    SPEC.loss(compiled, tokens).backward()
    elapsed = time.perf_counter() - start
    _reset_model_grads(model)
    return elapsed


def per_call_seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def interleaved(fns: dict, repeats: int, calls: int) -> dict:
    """{name: median per-call seconds}, the candidates alternating block by block."""
    samples = {name: [] for name in fns}
    for r in range(repeats):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            samples[name].append(per_call_seconds(fns[name], calls))
    return {name: statistics.median(s) for name, s in samples.items()}


def bench_compile(layers: int, repeats: int, drivers) -> dict:
    """{driver: (ours, aot_eager)} median first-step seconds; all candidates interleaved."""
    model = SPEC.make(num_layers=layers)
    (tokens,) = SPEC.example_inputs()
    candidates = [("aot_eager", "aot_eager", None)] + [(d, OURS, SPEC.options(driver=d)) for d in drivers]
    warm = SPEC.make(num_layers=1)  # first use of each backend pays imports and lazy init: not compile time
    for _, backend, options in candidates:
        first_step_seconds(warm, tokens, backend, options)
    samples = {name: [] for name, _, _ in candidates}
    for r in range(repeats):
        for name, backend, options in (candidates if r % 2 == 0 else candidates[::-1]):
            samples[name].append(first_step_seconds(model, tokens, backend, options))
    base = statistics.median(samples["aot_eager"])
    return {d: (statistics.median(samples[d]), base) for d in drivers}


def bench_steady(layers: int, repeats: int, calls: int) -> dict:
    """{"forward": (ours, base), "fwd+bwd": (ours, base)} median seconds per call."""
    model = SPEC.make(num_layers=layers)
    (tokens,) = SPEC.example_inputs()
    torch._dynamo.reset()
    ours = torch.compile(model, backend=OURS, options={"driver": "eager"})
    base = torch.compile(model, backend="eager")

    def fwd(compiled):
        return lambda: compiled(tokens)

    def step(compiled):
        def run():
            SPEC.loss(compiled, tokens).backward()
            _reset_model_grads(model)
        return run

    for fn in (fwd(ours), fwd(base), step(ours), step(base)):
        for _ in range(5):  # compile, and anything the runtime does in its first calls
            fn()
    forward = interleaved({"ours": fwd(ours), "base": fwd(base)}, repeats, calls)
    train = interleaved({"ours": step(ours), "base": step(base)}, repeats, calls)
    return {"forward": (forward["ours"], forward["base"]), "fwd+bwd": (train["ours"], train["base"])}


def bench_explain(small: int, large: int, repeats: int) -> tuple:
    (tokens,) = SPEC.example_inputs()
    models = {n: SPEC.make(num_layers=n) for n in (small, large)}
    options = SPEC.options()
    cgcompile.explain(SPEC.make(num_layers=1), tokens, options=options)  # warm imports
    samples = {small: [], large: []}
    for r in range(repeats):
        for n in ((small, large) if r % 2 == 0 else (large, small)):
            start = time.perf_counter()
            cgcompile.explain(models[n], tokens, options=options)
            samples[n].append(time.perf_counter() - start)
    return statistics.median(samples[large]), statistics.median(samples[small])


def profile(label: str, fn, top: int) -> None:
    """cProfile one call of `fn`; print the top functions by cumulative and by own time."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        body = out.getvalue()
        for prefix in (os.path.dirname(os.path.dirname(torch.__file__)), ROOT):  # torch/..., cgcompile/...
            body = body.replace(prefix + os.sep, "")
        body = body[body.find("   ncalls"):] if "   ncalls" in body else body
        print(f"\n--- profile {label}, by {key} ---\n{body.rstrip()}")


def fmt_time(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"


PADDING_GOALS = {"max": 0.10, "buckets": 0.20}  # host kernel ops outside graphs per step, vs eager
PADDING_EXPERTS, PADDING_BATCH = 8, (4, 32)  # 8 experts top-2 over 128 tokens: the GPU benchmark's routing shape


def bench_padding(layers: int, warmup: int, steps: int) -> dict:
    """(d) per MoE training step with new tokens every step (emulate driver): kernel ops still run op by op on
    the host (the launches a GPU would pay) and host reads of device data, for eager and each dynamic_padding."""
    from cgcompile.profiling import HostOpCounter
    results = {}
    for mode in ("eager", "off", "max", "buckets"):
        torch._dynamo.reset()
        model = SPEC.make(num_layers=layers, num_experts=PADDING_EXPERTS)
        run = model if mode == "eager" else torch.compile(model, backend=OURS, options={
            "driver": "emulate", "dynamic_padding": mode, "cuda_graph_warmup_steps": 1})

        def step(seed):  # a training step as torch's optimizers expect it: grads cleared to None after it
            (tokens,) = SPEC.example_inputs(batch=PADDING_BATCH[0], seq=PADDING_BATCH[1], seed=seed)
            SPEC.loss(run, tokens).backward()
            model.zero_grad(set_to_none=True)

        for seed in range(warmup):
            step(seed)
        with HostOpCounter() as counter:
            for seed in range(warmup, warmup + steps):
                step(seed)
        results[mode] = (counter.ops / steps, counter.syncs / steps, counter.replays / steps, counter.flops / steps)
    return results


def print_padding(layers: int, results: dict) -> None:
    eager_ops, eager_flops = results["eager"][0], results["eager"][3]
    print(f"\ndynamic_padding (d): {layers}-layer MoE training step, {PADDING_EXPERTS} experts top-2, tokens "
          f"{PADDING_BATCH}, new tokens every step, driver=emulate: per step")
    print("mode      host kernel ops  vs eager  goal      host syncs  graph replays  matmul FLOPs vs eager  result")
    for mode, (ops, syncs, replays, flops) in results.items():
        goal = PADDING_GOALS.get(mode)
        ok = goal and within(ops / eager_ops, goal) and (mode != "max" or syncs == 0)
        verdict = ("PASS" if ok else "MISS") if goal else ""
        goal_text = f"<= {goal:.2f}x" if goal else ""
        print(f"{mode:<8}  {ops:>15.1f}  {ops / eager_ops:>7.2f}x  {goal_text:<8}  {syncs:>10.1f}  {replays:>13.1f}"
              f"  {flops / eager_flops:>20.2f}x  {verdict}".rstrip())


HF_GOAL = 0.05  # host kernel ops outside graphs per training step, vs eager


def bench_hf(warmup: int, steps: int, dtypes=(torch.float32, torch.bfloat16)) -> dict:
    """(f) {(dtype, mode): per-step counts} for the HF Mixtral training step, eager vs captured (emulate)."""
    import hf_moe
    from cgcompile.profiling import HostOpCounter
    results = {}
    for dtype in dtypes:
        for mode in ("eager", "captured"):
            torch._dynamo.reset()
            model = hf_moe.build(dtype=dtype)
            if model is None:
                return {}
            run = model if mode == "eager" else torch.compile(model, backend=OURS, options={
                "driver": "emulate", "cuda_graph_modules": [], "cuda_graph_warmup_steps": 1})
            step = hf_moe.make_step(model, run, batch=2, seq=16)
            for _ in range(warmup):
                step()
            with HostOpCounter() as counter:
                for _ in range(steps):
                    step()
            results[(str(dtype).replace("torch.", ""), mode)] = (
                counter.ops / steps, counter.syncs / steps, counter.replays / steps, counter.flops / steps)
    return results


def print_hf(results: dict) -> None:
    if not results:
        print("\nHF MoE (f): skipped, transformers is not installed")
        return
    print("\nHF MoE (f): transformers Mixtral, 2 layers, d=32, 4 experts top-2, default experts implementation, "
          "tokens (2, 16), new tokens every step, driver=emulate, cuda_graph_modules=[]: per training step")
    print("dtype     mode      host kernel ops  vs eager  goal      host syncs  graph replays  matmul FLOPs vs eager  "
          "result")
    for (dtype, mode), (ops, syncs, replays, flops) in results.items():
        eager_ops, eager_flops = results[(dtype, "eager")][0], results[(dtype, "eager")][3]
        goal = HF_GOAL if mode != "eager" else None
        verdict = ("PASS" if within(ops / eager_ops, goal) else "MISS") if goal else ""
        goal_text = f"<= {goal:.2f}x" if goal else ""
        print(f"{dtype:<8}  {mode:<8}  {ops:>15.1f}  {ops / eager_ops:>7.2f}x  {goal_text:<8}  {syncs:>10.1f}  "
              f"{replays:>13.1f}  {flops / eager_flops:>20.2f}x  {verdict}".rstrip())


def print_replay_cost(quick: bool) -> None:
    """Table (g): host time per replay vs a minimal wrapper, its growth with depth, reuse on the issue-27 loops."""
    import replay_cost
    import reuse_loops

    calls, repeats = (60, 3) if quick else (2000, 7)
    from cgcompile import _compat

    print("\n(g) host time per replay (emulated replays made no-ops: the work around a launch), same process, "
          f"medians of interleaved repeats; fixed-address check: {_compat.ADDRESS_CHECK_IMPL}")
    rows = []
    layers, rounds = (2, 200) if quick else (8, 2000)
    for scope, (ours, minimal) in replay_cost.decode_call_times(layers=layers, rounds=rounds).items():
        rows.append((f"decode step, {layers} layers, {scope} scope, per partition call in a real loop (the step over "
                     f"its bound)", "minimal wrapper", ours, minimal, 2.0))
    depths = replay_cost.depth_host_times((8, 24, 96), steps=2 if quick else 4, repeats=repeats)
    for layers in (24, 96):
        rows.append((f"training, a break per layer, per forward partition call, {layers} vs 8 layers", "8 layers",
                     depths[layers], depths[8], 1.2))
    for name, vs, o, b, goal in rows:
        verdict = judged(o / b, goal)
        print(f"  {name}: {o * 1e6:.1f} us vs {vs} {b * 1e6:.1f} us: {o / b:.2f}x, goal <= {goal:.2f}x  {verdict}")
    checks = replay_cost.address_check_times(calls=calls, repeats=repeats)
    print("  fixed-address check of 118 parameters, per way available here: " +
          ", ".join(f"{impl} {seconds * 1e6:.2f} us" for impl, seconds in checks.items()))
    print("(g) reuse on the loops of issue 27 (reuse: replays per call after the capture step)")
    for name, row, goal, met in reuse_loops.reuse_rows(quick):
        print(f"  {name}: captured {row['captured']}, live {row['live']}, released {row['released']}, stops "
              f"{row['stops']}, eager fallbacks {row['fallbacks']}, reuse {row['reuse']:.2f}; goal: {goal}  "
              f"{'PASS' if met else 'MISS'}")


LEAN_STEP_GOALS = {"layer": 1.6, "block": 1.3}  # whole decode step's host time vs Dynamo's floor
INNER_HOST_GOAL = 1.2  # host time per partition call, inner_compiler="inductor" vs "eager"


def print_lean_step(quick: bool) -> None:
    """Table (g), continued: the whole decode step's host time against Dynamo's own floor in a real decode loop (a
    new position every step), and the host time per partition call with the Inductor inner compiler against the
    eager one's (issue 36). Quick: 2 layers, and the Inductor row left out (its C++ compile takes minutes here)."""
    import replay_cost

    layers, rounds = (2, 60) if quick else (8, 2000)
    found = replay_cost.decode_step_times(layers=layers, rounds=rounds, python_path=True)
    print(f"(g) lean step: {layers}-layer decode step in a real loop (a new position every step), host time per "
          f"step, replays as launches, vs Dynamo's floor (a backend returning cached outputs), medians of {rounds} "
          f"rounds of 5 steps of each candidate in turn; "
          f"reference: a minimal backend copying the inputs in and cloning its outputs "
          f"{found['minimal'] * 1e6:.1f} us, {found['minimal'] / found['floor']:.2f}x")
    for scope, goal in LEAN_STEP_GOALS.items():
        ratio = found[scope] / found["floor"]
        print(f"  {scope} scope: {found[scope] * 1e6:.1f} us vs floor {found['floor'] * 1e6:.1f} us: {ratio:.2f}x, "
              f"goal <= {goal:.2f}x  {judged(ratio, goal)}")
    python = found["block python"]
    print(f"  block scope with the host path in Python (where cgcompile's compiled helpers are not built): "
          f"{python * 1e6:.1f} us, {python / found['floor']:.2f}x the floor")
    bound = found["layer bound"]
    print(f"  layer scope's bound (its layers answered from a cache, the glue between them eager as the plan leaves "
          f"it: what no runtime goes below): {bound * 1e6:.1f} us, {bound / found['floor']:.2f}x the floor; layer "
          f"scope {found['layer'] / bound:.2f}x its bound")
    if quick:
        print("  inner_compiler inductor vs eager, per partition call: left out by --quick (Inductor's C++ compile)")
        return
    for scope in LEAN_STEP_GOALS:
        times = replay_cost.inner_host_times(scope, layers=layers, calls=2000, repeats=7)
        ratio = times["inductor"] / times["eager"]
        print(f"  inner_compiler inductor vs eager, {scope} scope, per partition call: {times['inductor'] * 1e6:.1f} "
              f"us vs {times['eager'] * 1e6:.1f} us: {ratio:.2f}x, goal <= {INNER_HOST_GOAL:.2f}x  "
              f"{judged(ratio, INNER_HOST_GOAL)}")


def print_kernels(quick: bool) -> None:
    """Table (j): kernels launched per step, cgcompile against whole-graph Inductor (benchmarks/kernel_count.py).
    Quick: the decode step at 2 layers against Dynamo's eager backend, without Inductor (its C++ compile)."""
    import kernel_count

    if quick:
        print("\n(j) kernels per step (QUICK: decode only, Dynamo's eager backend as the baseline, no Inductor)")
        kernel_count.table(["decode"], ("eager", "cg-eager"), base="eager", ours=None, warmup=6, steps=1)
        return
    print(f"\n(j) kernels per step (torch.profiler: Inductor's C++ kernels, extern kernels, every aten kernel outside "
          f"a graph; emulate driver), cgcompile-inductor vs whole-graph Inductor, goal <= {kernel_count.GOAL:.2f}x")
    kernel_count.table(kernel_count.WORKLOADS)


def print_scale(quick: bool, repeats: int) -> None:
    """Table (h): planning, capture and per-step host time at 48 vs 12 layers (benchmarks/scale_cost.py)."""
    if quick:
        print("\n(h) scale at depth: left out by --quick (python benchmarks/scale_cost.py --quick: 12 vs 3 layers)")
        return
    import scale_cost

    small, large = 12, 48
    found = scale_cost.run(small, large, repeats)
    print(f"\n(h) scale at depth: {large} vs {small} layers, {scale_cost.EXPERTS} experts top-{scale_cost.TOP_K} per "
          f"layer, hidden {scale_cost.HIDDEN}, training step, driver=emulate, process CPU time, medians of {repeats}")
    for what, a, b, ratio, verdict in scale_cost.table(found, small, large):
        goal = f" <= {scale_cost.GOAL:.2f}x" if verdict != "-" else ""
        print(f"  {what}: {fmt_time(a)} vs {fmt_time(b)}: {ratio:.2f}x{goal}  {verdict}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, one repeat: a smoke run for CI")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per metric (default 3, quick 1)")
    parser.add_argument("--profile", action="store_true", help="cProfile our side of each metric")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--emulate", action="store_true",
                        help="also time (a) with driver=emulate (the compile work a GPU run does; adds ~15 s)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    repeats = args.repeats or (1 if args.quick else 3)
    compile_layers, explain_layers = (2, (1, 4)) if args.quick else (8, (4, 16))
    steady_calls = 10 if args.quick else 40
    steady_repeats = 3 if args.quick else 2 * repeats + 1

    print(f"cgcompile CPU benchmark, {datetime.date.today().isoformat()}; torch {torch.__version__}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s)"
          f"{'; QUICK (smoke run, not the reference numbers)' if args.quick else ''}")
    print(f"model: tests/models moe_mask (d=32, 4 experts top-2), tokens (2, 8); repeats {repeats}, medians\n")
    started = time.perf_counter()
    rows = []
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for driver, (ours, base) in bench_compile(compile_layers, repeats, ("auto", "emulate") if args.emulate else ("auto",)).items():
            rows.append((f"(a) first fwd+bwd after reset, {compile_layers}-layer, driver={driver}", "aot_eager",
                         ours, base, 1.3))
        steady = bench_steady(compile_layers, steady_repeats, steady_calls)
        for what, (ours, base) in steady.items():
            rows.append((f"(b) steady {what}, {compile_layers}-layer, driver=eager", "eager backend", ours, base, 1.1))
        small, large = explain_layers
        ours, base = bench_explain(small, large, repeats)
        rows.append((f"(c) explain(), {large} vs {small} layers", f"{small} layers", ours, base, 5.0))

        header = ("metric", "cgcompile", "baseline", "vs", "ratio", "goal", "result")
        table = [header] + [
            (name, fmt_time(o), fmt_time(b), vs, f"{o / b:.2f}x", f"<= {goal:.2f}x",
             judged(o / b, goal))
            for name, vs, o, b, goal in rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        for row in table:
            print("  ".join(c.ljust(w) if i in (0, 3, 6) else c.rjust(w)
                            for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        padding_layers = 2
        print_padding(padding_layers, bench_padding(padding_layers, warmup=4 if args.quick else 16,
                                                    steps=2 if args.quick else 8))
        bank_steps = 16 if args.quick else 40  # the last 10 steps of a quick run are past warmup too
        bank_table.print_bank(bank_steps)
        print_hf(bench_hf(warmup=2 if args.quick else 4, steps=2 if args.quick else 8,
                          dtypes=(torch.bfloat16,) if args.quick else (torch.float32, torch.bfloat16)))
        print_replay_cost(args.quick)
        print_lean_step(args.quick)
        print_scale(args.quick, repeats)
        if args.quick:  # two HF training runs; tests/test_graph_economy.py checks the kinds add up
            print("\n(i) what the graphs hold: left out by --quick (python benchmarks/memory_table.py --quick)")
        else:
            memory_table.print_memory_table(False)
            memory_table.print_recompiled_frames()
        print_kernels(args.quick)
        print(f"\ntotal {time.perf_counter() - started:.0f} s")

        if args.profile:
            model = SPEC.make(num_layers=compile_layers)
            (tokens,) = SPEC.example_inputs()
            profile("(a) cgcompile first step, driver=emulate",
                    lambda: first_step_seconds(model, tokens, OURS, SPEC.options(driver="emulate")), 25)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=OURS, options={"driver": "eager"})
            for _ in range(5):
                compiled(tokens)
            profile("(b) cgcompile steady forward x200", lambda: [compiled(tokens) for _ in range(200)], 25)
            big = SPEC.make(num_layers=explain_layers[1])
            profile(f"(c) explain {explain_layers[1]} layers",
                    lambda: cgcompile.explain(big, tokens, options=SPEC.options()), 25)
    return 0


if __name__ == "__main__":
    sys.exit(main())

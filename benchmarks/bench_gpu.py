"""GPU benchmark: cgcompile's partial CUDA graphs against eager, Inductor and Inductor's reduce-overhead.

Launch-bound workloads, each run under every variant:
  moe:    one training step (forward + backward, no optimizer) of the tiny-model MoE from tests/models/moe.py
          built at 8 layers, d=512, 8 experts top-2, bf16, small batch; mask dispatch (torch.nonzero per
          expert, data-dependent), so a whole-step graph is impossible and capture must be partial.
  decode: one greedy decode step (torch.no_grad) of the KV-cache GPT from tests/models/kv_gpt.py at 8 layers,
          d=512, bf16, fixed batch: static cache in buffers written in place at a tensor position (gpt-fast
          style), after an eager prefill.
  decode-varying: the same step with a batch that changes every step (1..--max-batch), as a server sees it.
Variants: eager, inductor (torch.compile default), reduce-overhead (torch.compile mode="reduce-overhead"),
cg-local-eager / cg-local-inductor (backend="cudagraph_modules", cuda_graph_impl="local", inner_compiler eager /
inductor), the same with "+sizes" (option capture_sizes: the batch padded to 1, 2, 4, ... up to the largest
batch; decode workloads only) and cg-full-iteration (whole-step capture; it refuses the MoE, which prints
"n/a: <why>"). Compiled variants use Dynamo's automatic dynamic shapes (a changing batch recompiles once with
a symbolic batch; reduce-overhead then records a graph per batch size).

    python benchmarks/bench_gpu.py             # on a CUDA machine; prints "skipped: no CUDA" and exits 0 elsewhere
    python benchmarks/bench_gpu.py --quick     # fewer timed steps
    python benchmarks/bench_gpu.py --models moe --variants eager,reduce-overhead,cg-local-eager
    python benchmarks/bench_gpu.py --cpu-smoke --quick   # plumbing check on CPU, tiny sizes: numbers meaningless
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.models

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import cgcompile  # noqa: E402
from tests.models import kv_gpt, moe  # noqa: E402

VARIANTS = ("eager", "inductor", "reduce-overhead", "cg-local-eager", "cg-local-inductor", "cg-full-iteration",
            "cg-local-eager+sizes", "cg-local-inductor+sizes")
MODELS = ("moe", "decode", "decode-varying")
COMPILE_CALLS = 5  # covers cgcompile's default 3 warmup steps + capture, and reduce-overhead's warmup + record


@dataclasses.dataclass
class Workload:
    """A model, how one step calls a (compiled) callable, and the cgcompile options that fit it."""

    name: str
    title: str
    module: nn.Module
    make_step: Callable[[Callable], Callable[[], None]]
    local_options: dict
    dynamo_flags: dict
    capture_sizes: Optional[List[int]] = None  # for the "+sizes" variants (decode workloads only)


@dataclasses.dataclass
class Result:
    variant: str
    error: Optional[str] = None
    compile_s: Optional[float] = None
    step_ms: Optional[float] = None
    peak_mib: Optional[float] = None
    busy_ms: Optional[float] = None
    stats: Optional[dict] = None


def moe_workload(args, device, dtype) -> Workload:
    model = moe.build(num_layers=args.layers, dispatch="mask", d_model=args.d_model, n_heads=args.heads,
                      num_experts=args.experts, top_k=2).to(device=device, dtype=dtype)
    (tokens,) = moe.example_inputs(batch=args.batch, seq=args.seq, device=device)

    def make_step(fn):
        def step():
            moe.loss(fn, tokens).backward()
            model.zero_grad(set_to_none=True)
        return step

    title = (f"moe: training step (fwd+bwd), {args.layers} layers, d={args.d_model}, {args.experts} experts top-2, "
             f"{str(dtype).replace('torch.', '')}, tokens ({args.batch}, {args.seq}), mask dispatch")
    return Workload("moe", title, model, make_step,
                    {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "moe_router", "moe_preprocess"]},
                    {"capture_dynamic_output_shape_ops": True})


def decode_workload(args, device, dtype, varying: bool = False) -> Workload:
    """Greedy decode with a static KV cache (tests/models/kv_gpt.py): prefill eagerly, then time decode steps.
    Positions cycle through the cache after the prompt. varying=True: the batch changes every step (a fixed
    pseudo-random sequence over 1..--max-batch, fresh token tensors, as a server builds each step's batch)."""
    max_batch = args.max_batch if varying else args.batch
    model = kv_gpt.build(num_layers=args.layers, d_model=args.d_model, n_heads=args.heads, max_batch=max_batch,
                         max_seq=args.seq + args.decode_positions).to(device=device, dtype=dtype).eval()
    module = kv_gpt.DecodeStep(model)
    (prompt,) = kv_gpt.example_inputs(batch=max_batch, seq=args.seq, device=device)
    first = kv_gpt.prefill(model, prompt)
    positions = kv_gpt.positions(model.max_seq, device)
    batches = [max_batch] * 16
    if varying:
        g = torch.Generator().manual_seed(0)
        batches = [int(b) + 1 for b in torch.randint(0, max_batch, (64,), generator=g)]
    tokens = [first[:b].clone() for b in batches]
    state = {"i": 0}

    def make_step(fn):
        def step():
            i = state["i"]
            state["i"] = i + 1
            with torch.no_grad():
                fn(tokens[i % len(tokens)], positions[args.seq + i % args.decode_positions])
        return step

    kind = f"batch changing every step (1..{max_batch})" if varying else f"batch {max_batch}"
    title = (f"{'decode-varying' if varying else 'decode'}: greedy KV-cache decode step (no_grad), {args.layers} "
             f"layers, d={args.d_model}, {str(dtype).replace('torch.', '')}, {kind}, prompt {args.seq}")
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64, 128) if s < max_batch] + [max_batch]
    return Workload("decode-varying" if varying else "decode", title, module, make_step,
                    {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"],
                     "inference_cuda_graph_scope": "block"}, {}, capture_sizes=sizes)


def build_variant(name: str, workload: Workload, driver: str) -> Callable:
    module = workload.module
    if name == "eager":
        return module
    if name == "inductor":
        return torch.compile(module)
    if name == "reduce-overhead":
        return torch.compile(module, mode="reduce-overhead")
    if name == "cg-full-iteration":
        options = {"cuda_graph_impl": "full_iteration", "driver": driver}
    else:
        inner = name.split("+")[0].rsplit("-", 1)[1]
        options = dict(workload.local_options, inner_compiler=inner, driver=driver)
    if name.endswith("+sizes"):
        if not workload.capture_sizes:
            raise ValueError("capture_sizes rows are for the decode workloads")
        options["capture_sizes"] = workload.capture_sizes
    return torch.compile(module, backend="cudagraph_modules", options=options)


def error_line(exc: BaseException) -> str:
    """The first line of the innermost meaningful error (Dynamo wraps backend errors in BackendCompilerFailed,
    whose own first line is only "backend=... raised:"), whole."""
    inner = exc
    while getattr(inner, "inner_exception", None) is not None:
        inner = inner.inner_exception
    lines = [line.strip() for line in str(inner).strip().splitlines() if line.strip()]
    if lines and lines[0].startswith("backend=") and len(lines) > 1:
        lines = lines[1:]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:  # "...cannot be captured:" is followed by the op that says why
        text = f"{text} {lines[1]}"
    return f"{type(inner).__name__}: {text}"  # never cut: the reason may follow a long checkout path


class Clock:
    """Per-step timing: CUDA events on a GPU (what the device saw), perf_counter in the CPU smoke run."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step_times_ms(self, step: Callable[[], None], n: int) -> List[float]:
        if not self.cuda:
            times = []
            for _ in range(n):
                mark_step()
                start = time.perf_counter()
                step()
                times.append((time.perf_counter() - start) * 1e3)
            return times
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            mark_step()
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]


def mark_step() -> None:
    """Tell cudagraph trees (reduce-overhead) a new step begins; harmless for the other variants."""
    torch.compiler.cudagraph_mark_step_begin()


def gpu_busy_ms(step: Callable[[], None], n: int) -> Optional[float]:
    """Sum of device activity (kernels, memcpy, memset) per step under torch.profiler: the step's lower bound."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            mark_step()
            step()
        torch.cuda.synchronize()
    total_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return total_us / n / 1e3 if total_us > 0 else None  # None: the profiler saw no device activity


def cleanup(cuda: bool) -> None:
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_variant(name: str, workload: Workload, args, clock: Clock) -> Result:
    result = Result(name)
    cleanup(clock.cuda)
    stats_fn, reset_fn = getattr(cgcompile, "stats", None), getattr(cgcompile, "reset_stats", None)
    if callable(reset_fn):
        reset_fn()
    if clock.cuda:
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
    flags = workload.dynamo_flags if name != "eager" else {}
    try:
        with torch._dynamo.config.patch(**flags):
            step = workload.make_step(build_variant(name, workload, args.driver))
            clock.sync()
            start = time.perf_counter()
            for _ in range(COMPILE_CALLS):
                mark_step()
                step()
            clock.sync()
            result.compile_s = time.perf_counter() - start
            clock.step_times_ms(step, 3)  # settle
            result.step_ms = statistics.median(clock.step_times_ms(step, args.steps))
            if clock.cuda:
                result.peak_mib = (torch.cuda.max_memory_allocated() - start_bytes) / 2**20
                result.busy_ms = gpu_busy_ms(step, args.profile_steps)
        if name.startswith("cg-") and callable(stats_fn):
            result.stats = stats_fn()
    except Exception as exc:  # one variant failing must not hide the others
        result.error = error_line(exc)
    finally:
        with contextlib.suppress(Exception):
            cleanup(clock.cuda)
    return result


def _num(value: Optional[float], fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def print_table(workload: Workload, results: Dict[str, Result]) -> None:
    eager = results.get("eager")
    ro = results.get("reduce-overhead")
    eager_ms = eager.step_ms if eager else None
    ro_ms = ro.step_ms if ro else None
    ro_compile = ro.compile_s if ro else None
    header = ("variant", "step ms", "speedup vs eager", "vs reduce-ovh", "compile+capture s", "/ reduce-ovh",
              "peak MiB", "GPU busy ms", "step / busy")
    rows = [header]
    for name, r in results.items():
        if r.error:
            rows.append((name, f"n/a: {r.error}"))
            continue
        rows.append((name, _num(r.step_ms, ".3f"), _num(_ratio(eager_ms, r.step_ms), ".2f", "x"),
                     _num(_ratio(ro_ms, r.step_ms), ".2f", "x"), _num(r.compile_s, ".2f"),
                     _num(_ratio(r.compile_s, ro_compile), ".2f", "x"), _num(r.peak_mib, ".0f"),
                     _num(r.busy_ms, ".3f"), _num(_ratio(r.step_ms, r.busy_ms), ".2f", "x")))
    widths = [max(len(row[i]) for row in rows if len(row) == len(header)) for i in range(len(header))]
    widths[0] = max(len(row[0]) for row in rows)
    print(f"\n{workload.title}")
    for row in rows:
        if len(row) != len(header):
            print(f"{row[0].ljust(widths[0])}  {row[1]}")
        else:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for name, r in results.items():
        if r.stats:
            fallbacks = r.stats.get("eager_fallbacks", [])
            print(f"  {name} stats: graphs_captured={r.stats.get('graphs_captured')}, replays={r.stats.get('replays')}, "
                  f"eager_fallbacks={len(fallbacks)}" + (f" (first: {fallbacks[0]})" if fallbacks else ""))


def goal_rows(all_results: Dict[str, Dict[str, Result]]) -> List[tuple]:
    """(goal, measured, PASS/MISS/n/a) for the issue's goals, for each cgcompile local variant that ran."""
    rows = []

    def get(workload, variant, attr):
        r = all_results.get(workload, {}).get(variant)
        return None if r is None or r.error else getattr(r, attr)

    def row(text, value, ok):
        rows.append((text, "-" if value is None else f"{value:.2f}x",
                     "n/a" if value is None else ("PASS" if ok(value) else "MISS")))

    for inner in ("eager", "inductor"):
        v = f"cg-local-{inner}"
        if v not in all_results.get("moe", {}) and v not in all_results.get("decode", {}):
            continue
        row(f"moe step >= 1.5x eager ({v})", _ratio(get("moe", "eager", "step_ms"), get("moe", v, "step_ms")),
            lambda x: x >= 1.5)
        row(f"moe step no slower than reduce-overhead ({v}; speedup)",
            _ratio(get("moe", "reduce-overhead", "step_ms"), get("moe", v, "step_ms")), lambda x: x >= 1.0)
        if inner == "eager":
            for w in ("moe", "decode"):
                row(f"{w} compile+capture <= 1/3 of reduce-overhead's ({v})",
                    _ratio(get(w, v, "compile_s"), get(w, "reduce-overhead", "compile_s")), lambda x: x <= 1 / 3)
        row(f"decode step within 1.1x of its GPU-busy bound ({v})",
            _ratio(get("decode", v, "step_ms"), get("decode", v, "busy_ms")), lambda x: x <= 1.1)
        if inner == "inductor":
            row(f"decode step no slower than reduce-overhead ({v}; speedup)",
                _ratio(get("decode", "reduce-overhead", "step_ms"), get("decode", v, "step_ms")), lambda x: x >= 1.0)
    if "cg-full-iteration" in all_results.get("decode", {}):
        row("decode step within 1.1x of its GPU-busy bound (cg-full-iteration)",
            _ratio(get("decode", "cg-full-iteration", "step_ms"), get("decode", "cg-full-iteration", "busy_ms")),
            lambda x: x <= 1.1)
    for v in ("cg-local-eager+sizes", "cg-local-inductor+sizes"):
        if v in all_results.get("decode-varying", {}):
            row(f"decode-varying step faster than reduce-overhead ({v}; speedup)",
                _ratio(get("decode-varying", "reduce-overhead", "step_ms"), get("decode-varying", v, "step_ms")),
                lambda x: x > 1.0)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed and profiled steps")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 100, quick 20)")
    parser.add_argument("--profile-steps", type=int, default=None, help="profiled steps (default 10, quick 3)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32, help="MoE tokens per sequence; decode prompt length")
    parser.add_argument("--max-batch", type=int, default=16, help="decode-varying: batches range over 1..this")
    parser.add_argument("--decode-positions", type=int, default=64,
                        help="decode: cache positions after the prompt that the timed steps cycle through")
    parser.add_argument("--driver", default="auto", help="cgcompile driver: auto | cuda | emulate | eager")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run the harness on CPU with tiny float32 models (checks plumbing; numbers meaningless)")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [v for v in variants if v not in VARIANTS] + [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown variant or model {unknown}; variants: {VARIANTS}; models: {MODELS}")
    args.steps = args.steps or (20 if args.quick else 100)
    args.profile_steps = args.profile_steps or (3 if args.quick else 10)

    now = datetime.datetime.now().isoformat(timespec="seconds")
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print(f"skipped: no CUDA (bench_gpu.py needs a CUDA device; torch {torch.__version__}, {now})")
        return 0
    if cuda:
        device, dtype = "cuda", torch.bfloat16
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, {now}")
    else:
        device, dtype = "cpu", torch.float32
        args.layers, args.d_model, args.heads, args.experts, args.batch, args.seq = 2, 32, 4, 4, 2, 8
        args.max_batch, args.decode_positions = 4, 16
        print(f"CPU SMOKE RUN (plumbing only, numbers meaningless): torch {torch.__version__}, {now}")
    torch._inductor.config.force_disable_caches = True  # cold compile times for every compiled variant
    warnings.filterwarnings("ignore", message=".*force_disable_caches.*")
    print(f"timed steps {args.steps} (median), profiled steps {args.profile_steps}, compile+capture = first "
          f"{COMPILE_CALLS} calls, cgcompile driver={args.driver}; Inductor caches disabled")

    clock = Clock(cuda)
    started = time.perf_counter()
    builders = {"moe": moe_workload, "decode": decode_workload,
                "decode-varying": lambda *a: decode_workload(*a, varying=True)}
    all_results: Dict[str, Dict[str, Result]] = {}
    for model_name in models:
        try:
            workload = builders[model_name](args, device, dtype)
        except Exception as exc:
            print(f"\n{model_name}: n/a: {error_line(exc)}")
            continue
        try:  # CUDA context, cuBLAS handles, lazy imports: paid once here, not by whichever variant runs first
            warm = workload.make_step(workload.module)
            for _ in range(3):
                mark_step()  # its first call imports cudagraph_trees
                warm()
            clock.sync()
        except Exception as exc:
            print(f"\n{model_name}: n/a: eager warmup failed: {error_line(exc)}")
            continue
        results = {}
        for variant in variants:
            results[variant] = run_variant(variant, workload, args, clock)
            r = results[variant]
            status = f"n/a: {r.error}" if r.error else f"{r.step_ms:.3f} ms/step, compile+capture {r.compile_s:.2f} s"
            print(f"  [{model_name}] {variant}: {status}", flush=True)
        all_results[model_name] = results
        print_table(workload, results)
        del workload
        cleanup(cuda)

    rows = goal_rows(all_results)
    if rows:
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        print("\ngoals")
        for text, value, verdict in rows:
            print(f"  {text.ljust(widths[0])}  {value.rjust(widths[1])}  {verdict}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU benchmark: cgcompile's partial CUDA graphs against eager, Inductor and Inductor's reduce-overhead.

Launch-bound workloads, each run under every variant:
  moe:       one training step (forward + backward, no optimizer) of the tiny-model MoE from tests/models/moe.py
             built at 8 layers, d=512, 8 experts top-2, bf16, small batch, with NEW tokens every step (a pool of
             --token-pool different batches, built on the device up front and cycled, as training feeds them):
             the routing, so every expert's row count, changes each step. Mask dispatch (torch.nonzero per
             expert, data-dependent), so without dynamic_padding a whole-step graph is impossible.
  moe-fixed: the same step on one fixed batch (the routing, hence every row count, repeats each step).
  mixtral:   the same kind of step on a Hugging Face Mixtral-style model (tests/models/mixtral.py: float softmax
             router, top-2, `torch.where(expert_mask[e])` expert loop, index_add_), same sizes, new tokens
             every step; tagged with tag_modules like a model whose source cannot be edited.
  decode:    one greedy decode step (torch.no_grad) of the KV-cache GPT from tests/models/kv_gpt.py at 8 layers,
             d=512, bf16, fixed batch: static cache in buffers written in place at a tensor position (gpt-fast
             style), after an eager prefill.
  decode-varying: the same step with a batch that changes every step (1..--max-batch), as a server sees it.
  hf-mixtral: a transformers MixtralForCausalLM training step (benchmarks/hf_moe.py, default experts
             implementation, cuda_graph_modules=[]), same sizes, new tokens every step. Run only when named in
             --models (it needs transformers); gpu_check.py names every model starting with "hf".
Variants: eager, inductor (torch.compile default), reduce-overhead (torch.compile mode="reduce-overhead"),
cg-local-eager / cg-local-inductor (backend="cudagraph_modules", cuda_graph_impl="local", inner_compiler eager /
inductor, the workload's recommended cuda_graph_modules), the same with "+sizes" (option capture_sizes: the
batch padded to 1, 2, 4, ... up to the largest batch; decode workloads only, refused for the MoE workloads),
"+max" / "+buckets" (option dynamic_padding; cuda_graph_modules left empty, i.e. every capture-safe span: the
expert loop is untagged in both MoE models, so a module list would leave it eager; MoE workloads only, refused
for decode, which has no data-dependent index op), cg-full-iteration (whole-step capture; it refuses the MoE
workloads, which print "n/a: <why>") and cg-full-iteration+max (whole-step capture with dynamic_padding="max":
the MoE step becomes one graph). There is no cg-local-inductor+buckets: every bucket of every expert would be
an Inductor compile. Compiled variants use Dynamo's automatic dynamic shapes (a changing batch recompiles once
with a symbolic batch; reduce-overhead then records a graph per batch size). Timed steps follow the compile
calls and a settle phase (for new-token workloads one pass over the token pool, so "+buckets" has met the
pool's bucket sizes once); each variant starts at the pool's first batch.

Columns: step ms (median; CUDA events around each step), speedup vs eager / reduce-overhead, compile+capture
(the first calls' wall time), peak MiB (max_memory_allocated above the variant's start), GPU busy ms (device
kernel + memcpy + memset time per step under torch.profiler) and, from the same profiled steps, per step:
  host launches: on CUDA, CUDA runtime/driver API calls on the host that launch device work outside graph
      launches (names containing LaunchKernel, LaunchCooperativeKernel, Memcpy or Memset: cudaLaunchKernel,
      cuLaunchKernel, cudaLaunchKernelExC, cudaMemcpyAsync, cudaMemsetAsync, ...); kernels inside a replayed
      graph make no such call. On CPU (--cpu-smoke) the proxy of cgcompile.profiling: top-level aten ops
      that run a kernel, outside the emulate driver's replays (Inductor's generated CPU kernels are not aten
      ops, so the proxy undercounts the inductor variants).
  graph launches: on CUDA, cudaGraphLaunch calls (names containing GraphLaunch); on CPU, emulated replays.
  host syncs: on both, top-level aten ops outside graph replays that read device data on the host, themselves
      or through an op they call (profiling.SYNC_OPS: nonzero, _local_scalar_dense i.e. .item(), unique,
      cgcompile's bucketed nonzero, ...). Runtime-level synchronize calls are not counted.
Each table names the definition its counts used. Goals are judged only on CUDA (the CPU smoke run prints the
measured ratio with verdict n/a).

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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for hf_moe

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import cgcompile  # noqa: E402
from cgcompile import profiling  # noqa: E402
import hf_moe  # noqa: E402
from tests.models import MODELS as TEST_MODELS  # noqa: E402
from tests.models import kv_gpt  # noqa: E402

PADDED_VARIANTS = ("cg-local-eager+max", "cg-local-eager+buckets", "cg-local-inductor+max", "cg-full-iteration+max")
VARIANTS = ("eager", "inductor", "reduce-overhead", "cg-local-eager", "cg-local-inductor", "cg-full-iteration",
            "cg-local-eager+sizes", "cg-local-inductor+sizes") + PADDED_VARIANTS
MODELS = ("moe", "moe-fixed", "mixtral", "decode", "decode-varying", "hf-mixtral")
DEFAULT_MODELS = tuple(m for m in MODELS if not m.startswith("hf"))  # HF rows need transformers: run when named
NEW_TOKEN_MOE = ("moe", "mixtral")  # the workloads the captured-experts goal is about
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
    paddable: bool = False  # the "+max" / "+buckets" variants apply (MoE workloads only)
    settle_steps: int = 3  # untimed steps between the compile calls and the timed ones


@dataclasses.dataclass
class Result:
    variant: str
    error: Optional[str] = None
    compile_s: Optional[float] = None
    step_ms: Optional[float] = None
    peak_mib: Optional[float] = None
    busy_ms: Optional[float] = None
    launches: Optional[float] = None  # per step; see the module docstring for what is counted where
    graph_launches: Optional[float] = None
    syncs: Optional[float] = None
    profile_error: Optional[str] = None  # the profiled pass failed: its columns stay "-", the timings stand
    stats: Optional[dict] = None


def moe_workload(args, device, dtype, name: str = "moe") -> Workload:
    """A MoE training step. "moe" / "moe-fixed": tests/models/moe.py (mask dispatch), new tokens every step /
    one batch; "mixtral": the HF-style tests/models/mixtral.py, new tokens every step. The spec in
    tests/models supplies build + tags, the loss, the recommended modules and the Dynamo flags."""
    spec = TEST_MODELS["mixtral" if name == "mixtral" else "moe_mask"]
    sizes = dict(num_layers=args.layers, n_heads=args.heads, num_experts=args.experts, top_k=2)
    sizes["hidden" if name == "mixtral" else "d_model"] = args.d_model
    model = spec.make(**sizes).to(device=device, dtype=dtype)
    varying = name != "moe-fixed"
    pool = [spec.example_inputs(batch=args.batch, seq=args.seq, seed=seed, device=device)[0]
            for seed in range(args.token_pool if varying else 1)]

    def make_step(fn):
        state = {"i": 0}  # per variant: every variant sees the same sequence of batches

        def step():
            tokens = pool[state["i"] % len(pool)]
            state["i"] += 1
            spec.loss(fn, tokens).backward()
            model.zero_grad(set_to_none=True)
        return step

    what = ("Mixtral-style sparse MoE block (float softmax router, top-2, torch.where(expert_mask[e]) loop)"
            if name == "mixtral" else "mask dispatch")
    feed = f"new tokens every step (pool of {len(pool)} batches)" if varying else "the same tokens every step"
    title = (f"{name}: training step (fwd+bwd), {args.layers} layers, d={args.d_model}, {args.experts} experts "
             f"top-2, {str(dtype).replace('torch.', '')}, tokens ({args.batch}, {args.seq}), {feed}, {what}")
    return Workload(name, title, model, make_step, spec.options(), spec.dynamo_flags(), paddable=True,
                    settle_steps=max(3, len(pool)))


def hf_workload(args, device, dtype) -> Workload:
    """A Hugging Face transformers Mixtral (benchmarks/hf_moe.py) training step, transformers' default experts
    implementation (grouped_mm: no host read), new tokens every step; cuda_graph_modules=[] captures each
    decoder layer whole."""
    model = hf_moe.build(layers=args.layers, hidden=args.d_model, experts=args.experts, heads=args.heads,
                         dtype=dtype, device=device)
    if model is None:
        raise RuntimeError("transformers is not installed")

    def make_step(fn):  # per variant: every variant sees the same sequence of batches
        return hf_moe.make_step(model, fn, args.batch, args.seq, device, pool=args.token_pool)

    title = (f"hf-mixtral: transformers MixtralForCausalLM training step (fwd+bwd), {args.layers} layers, "
             f"d={args.d_model}, {args.experts} experts top-2, {str(dtype).replace('torch.', '')}, tokens "
             f"({args.batch}, {args.seq}), new tokens every step, default experts implementation")
    return Workload("hf-mixtral", title, model, make_step, {"cuda_graph_modules": []}, {},
                    settle_steps=max(3, args.token_pool))


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


def variant_options(name: str, workload: Workload, driver: str) -> dict:
    """The cgcompile options of a "cg-..." variant: base (local-eager / local-inductor / full-iteration) plus an
    optional "+sizes" / "+max" / "+buckets" suffix."""
    base, _, suffix = name.partition("+")
    if suffix in ("max", "buckets") and not workload.paddable:
        raise ValueError("dynamic_padding rows are for the MoE workloads (decode has no data-dependent index op)")
    if base == "cg-full-iteration":
        options = {"cuda_graph_impl": "full_iteration", "driver": driver}
    elif suffix in ("max", "buckets"):  # every capture-safe span: the untagged expert loop is what padding frees
        options = {"cuda_graph_impl": "local", "inner_compiler": base.rsplit("-", 1)[1], "driver": driver}
    else:
        options = dict(workload.local_options, inner_compiler=base.rsplit("-", 1)[1], driver=driver)
    if suffix == "sizes":
        if not workload.capture_sizes:
            raise ValueError("capture_sizes rows are for the decode workloads")
        options["capture_sizes"] = workload.capture_sizes
    elif suffix in ("max", "buckets"):
        options["dynamic_padding"] = suffix
    return options


def build_variant(name: str, workload: Workload, driver: str) -> Callable:
    module = workload.module
    if name == "eager":
        return module
    if name == "inductor":
        return torch.compile(module)
    if name == "reduce-overhead":
        return torch.compile(module, mode="reduce-overhead")
    return torch.compile(module, backend="cudagraph_modules", options=variant_options(name, workload, driver))


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


LAUNCH_MARKERS = ("LaunchKernel", "LaunchCooperativeKernel", "Memcpy", "Memset")  # runtime/driver API names
COUNT_DEFINITIONS = {
    True: "CUDA runtime/driver API calls under torch.profiler (launches: *LaunchKernel*/*Memcpy*/*Memset* outside "
          "graph launches; graph launches: *GraphLaunch*); syncs: top-level aten ops reaching profiling.SYNC_OPS",
    False: "CPU proxy, cgcompile.profiling (launches: top-level aten kernel ops outside emulated replays; "
           "graph launches: emulated replays; syncs: those ops reaching profiling.SYNC_OPS)",
}


def is_launch_call(name: str) -> bool:
    """A host-side CUDA runtime/driver call that starts device work on its own (not a graph launch). Matched by
    substring: the exact names (cudaLaunchKernel, cudaLaunchKernelExC, cuLaunchKernelEx, ...) vary by version."""
    return name.startswith("cu") and "GraphLaunch" not in name and any(m in name for m in LAUNCH_MARKERS)


def cuda_profile(step: Callable[[], None], n: int) -> tuple:
    """One torch.profiler pass over n steps -> cuda_counts of its events."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            mark_step()
            step()
        torch.cuda.synchronize()
    return cuda_counts(prof.events(), n)


def cuda_counts(events, n: int) -> tuple:
    """Per step (GPU busy ms or None, host launches, graph launches, host syncs) from profiler events of n steps
    (see the module docstring for what each counts). Device-side events (kernels, and memcpy/memset named
    "Memcpy HtoD ...") only add to busy time."""
    from torch.autograd import DeviceType

    busy_us = launches = graphs = 0
    for e in events:
        if e.device_type == DeviceType.CUDA:
            busy_us += e.time_range.elapsed_us()
        elif "GraphLaunch" in e.name:
            graphs += 1
        elif is_launch_call(e.name):
            launches += 1
    _, syncs, _ = profiling.count_events(events)
    busy = busy_us / n / 1e3 if busy_us > 0 else None  # None: the profiler saw no device activity
    return busy, launches / n, graphs / n, syncs / n


def cpu_counts(step: Callable[[], None], n: int) -> tuple:
    """The CPU proxy over n steps -> per step (host kernel ops, emulated graph replays, host syncs)."""
    with profiling.HostOpCounter() as counter:
        for _ in range(n):
            mark_step()
            step()
    return counter.ops / n, counter.replays / n, counter.syncs / n


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
            clock.step_times_ms(step, workload.settle_steps)
            result.step_ms = statistics.median(clock.step_times_ms(step, args.steps))
            if clock.cuda:
                result.peak_mib = (torch.cuda.max_memory_allocated() - start_bytes) / 2**20
            try:  # never run on this torch/CUDA before: a profiler problem must not hide the timings
                if clock.cuda:
                    (result.busy_ms, result.launches, result.graph_launches,
                     result.syncs) = cuda_profile(step, args.profile_steps)
                else:
                    result.launches, result.graph_launches, result.syncs = cpu_counts(step, args.profile_steps)
            except Exception as exc:
                result.profile_error = error_line(exc)
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


def print_table(workload: Workload, results: Dict[str, Result], cuda: bool) -> None:
    eager = results.get("eager")
    ro = results.get("reduce-overhead")
    eager_ms = eager.step_ms if eager else None
    ro_ms = ro.step_ms if ro else None
    ro_compile = ro.compile_s if ro else None
    header = ("variant", "step ms", "speedup vs eager", "vs reduce-ovh", "compile+capture s", "/ reduce-ovh",
              "peak MiB", "GPU busy ms", "step / busy", "launches", "graph launches", "syncs")
    rows = [header]
    for name, r in results.items():
        if r.error:
            rows.append((name, f"n/a: {r.error}"))
            continue
        rows.append((name, _num(r.step_ms, ".3f"), _num(_ratio(eager_ms, r.step_ms), ".2f", "x"),
                     _num(_ratio(ro_ms, r.step_ms), ".2f", "x"), _num(r.compile_s, ".2f"),
                     _num(_ratio(r.compile_s, ro_compile), ".2f", "x"), _num(r.peak_mib, ".0f"),
                     _num(r.busy_ms, ".3f"), _num(_ratio(r.step_ms, r.busy_ms), ".2f", "x"),
                     _num(r.launches, ".1f"), _num(r.graph_launches, ".1f"), _num(r.syncs, ".1f")))
    widths = [max(len(row[i]) for row in rows if len(row) == len(header)) for i in range(len(header))]
    widths[0] = max(len(row[0]) for row in rows)
    print(f"\n{workload.title}")
    for row in rows:
        if len(row) != len(header):
            print(f"{row[0].ljust(widths[0])}  {row[1]}")
        else:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print(f"  launches / graph launches / syncs per step: {COUNT_DEFINITIONS[cuda]}")
    for name, r in results.items():
        if r.profile_error:
            print(f"  {name}: profiled pass failed ({r.profile_error}): busy and count columns are '-'")
    for name, r in results.items():
        if r.stats:
            fallbacks = r.stats.get("eager_fallbacks", [])
            print(f"  {name} stats: graphs_captured={r.stats.get('graphs_captured')}, replays={r.stats.get('replays')}, "
                  f"eager_fallbacks={len(fallbacks)}" + (f" (first: {fallbacks[0]})" if fallbacks else ""))


def goal_rows(all_results: Dict[str, Dict[str, Result]], judged: bool = True) -> List[tuple]:
    """(goal, measured, PASS/MISS/n/a) for the issues' goals, for each cgcompile variant that ran. judged=False
    (CPU smoke: no GPU timings) still shows the ratios, with verdict n/a."""
    rows = []

    def get(workload, variant, attr):
        r = all_results.get(workload, {}).get(variant)
        return None if r is None or r.error else getattr(r, attr)

    def row(text, value, ok):
        rows.append((text, "-" if value is None else f"{value:.2f}x",
                     "n/a" if value is None or not judged else ("PASS" if ok(value) else "MISS")))

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
    for w in NEW_TOKEN_MOE:  # experts captured with dynamic_padding, new tokens every step
        for v in PADDED_VARIANTS:
            if v not in all_results.get(w, {}):
                continue
            row(f"{w} step >= 3x eager ({v})", _ratio(get(w, "eager", "step_ms"), get(w, v, "step_ms")),
                lambda x: x >= 3.0)
            row(f"{w} step >= 2x reduce-overhead ({v}; speedup)",
                _ratio(get(w, "reduce-overhead", "step_ms"), get(w, v, "step_ms")), lambda x: x >= 2.0)
            row(f"{w} step within 1.5x of its GPU-busy bound ({v})",
                _ratio(get(w, v, "step_ms"), get(w, v, "busy_ms")), lambda x: x <= 1.5)
            row(f"{w} peak memory <= 1.5x eager's ({v})",
                _ratio(get(w, v, "peak_mib"), get(w, "eager", "peak_mib")), lambda x: x <= 1.5)
    return rows


def host_time_rows(device: str, quick: bool) -> None:
    """Host time per replay, cgcompile vs a minimal CUDA-graph wrapper in this process (benchmarks/replay_cost.py,
    bench_cpu's table (g) on real graphs): the 8-layer KV decode in layer and block scope. Goal: <= 2x."""
    import replay_cost

    print("\nhost time per replay, same process, medians (goal <= 2.00x the minimal wrapper)")
    for scope in ("layer", "block"):
        try:
            ours, minimal = replay_cost.decode_host_times(scope, calls=50 if quick else 200,
                                                          repeats=3 if quick else 5, device=device)
        except Exception as exc:
            print(f"  decode {scope} scope: n/a: {error_line(exc)}")
            continue
        print(f"  decode {scope} scope: {ours * 1e6:.1f} us vs minimal {minimal * 1e6:.1f} us: {ours / minimal:.2f}x")
    try:  # which way of checking fixed addresses is fastest on this build (the runtime uses the first listed)
        checks = replay_cost.address_check_times(calls=200 if quick else 2000, device=device)
        print("  fixed-address check of 118 parameters: " +
              ", ".join(f"{impl} {seconds * 1e6:.2f} us" for impl, seconds in checks.items()))
    except Exception as exc:
        print(f"  fixed-address check: n/a: {error_line(exc)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed and profiled steps")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated: {', '.join(MODELS)} (default: all but the hf ones)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 100, quick 20)")
    parser.add_argument("--profile-steps", type=int, default=None, help="profiled steps (default 10, quick 3)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32, help="MoE tokens per sequence; decode prompt length")
    parser.add_argument("--token-pool", type=int, default=32,
                        help="moe, mixtral: different token batches cycled, one per step")
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
    if args.token_pool < 1:
        parser.error("--token-pool must be >= 1")
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
        args.layers, args.d_model, args.heads, args.experts, args.batch, args.seq = 1, 32, 4, 4, 2, 8
        args.max_batch, args.decode_positions = 4, 16
        print(f"CPU SMOKE RUN (plumbing only, numbers meaningless): torch {torch.__version__}, {now}")
    torch._inductor.config.force_disable_caches = True  # cold compile times for every compiled variant
    warnings.filterwarnings("ignore", message=".*force_disable_caches.*")
    print(f"timed steps {args.steps} (median), profiled steps {args.profile_steps}, compile+capture = first "
          f"{COMPILE_CALLS} calls, cgcompile driver={args.driver}; Inductor caches disabled")

    clock = Clock(cuda)
    started = time.perf_counter()
    builders = {"moe": moe_workload, "moe-fixed": lambda *a: moe_workload(*a, name="moe-fixed"),
                "mixtral": lambda *a: moe_workload(*a, name="mixtral"), "decode": decode_workload,
                "decode-varying": lambda *a: decode_workload(*a, varying=True), "hf-mixtral": hf_workload}
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
        print_table(workload, results, cuda)
        del workload
        cleanup(cuda)

    if "decode" in models:
        host_time_rows(device if cuda else "cpu", args.quick)
    rows = goal_rows(all_results, judged=cuda)
    if rows:
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        print("\ngoals" + ("" if cuda else " (CPU smoke: ratios shown, not judged)"))
        for text, value, verdict in rows:
            print(f"  {text.ljust(widths[0])}  {value.rjust(widths[1])}  {verdict}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

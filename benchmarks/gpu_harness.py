"""The GPU benchmark's harness: variants, timing, GPU-busy time, peak memory, compile+capture, tables.

bench_gpu.py builds workloads (workloads_small.py: the launch-bound toys; workloads_hf.py: Hugging Face models
at the sizes people train and serve) and runs each through the variants here; gpu_perf.py runs bench_gpu.py
stage by stage inside one time budget. A variant is a name:
  eager, inductor (torch.compile default), reduce-overhead (torch.compile mode="reduce-overhead"),
  cg-local-eager / cg-local-inductor (backend="cudagraph_modules", cuda_graph_impl="local", inner_compiler eager
  / inductor, the workload's recommended options), cg-full-iteration (whole-step capture),
followed by suffixes, each "+name": "+sizes" (capture_sizes, decode), "+max" / "+buckets" / "+off"
(dynamic_padding; MoE with a data-dependent dispatch), "+layer" / "+block" (inference_cuda_graph_scope, decode).
What is measured per variant (run_variant): step time (median over timed steps; CUDA events on a GPU), GPU-busy
time (device kernel + memcpy + memset time per step under torch.profiler), step / busy, peak memory allocated
above the variant's start (and vs eager), compile+capture (wall time of the first COMPILE_CALLS calls), host
launches / graph launches / syncs per step and a per-kernel table (gpu_kernels.py) from the same profiled pass,
and where the workload asks for it, the largest difference of its outputs from eager's over the same steps
(every variant starts from the same weights and data). The goals judged from the rows: gpu_goals.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

import cgcompile
from cgcompile import profiling
from gpu_kernels import cpu_kernel_table, cuda_kernel_table

COMPILE_CALLS = 5  # covers cgcompile's default 3 warmup steps + capture, and reduce-overhead's warmup + record
PADDED_VARIANTS = ("cg-local-eager+max", "cg-local-eager+buckets", "cg-local-inductor+max", "cg-full-iteration+max")
SUFFIXES = ("sizes", "max", "buckets", "off", "layer", "block")
INDUCTOR_VARIANTS = ("inductor", "reduce-overhead", "cg-local-inductor")  # bases that run Inductor
CUDA_ONLY = {"reduce-overhead": "needs CUDA (cudagraph trees record real CUDA graphs)"}


@dataclasses.dataclass
class Workload:
    """A model, how one step calls a (compiled) callable, and the cgcompile options that fit it.

    make_step(fn) returns a step; a step may return a tensor (the loss, the logits), which `check` workloads
    compare with eager's. reset(), when given, runs before each variant (and before eager): it puts back the
    weights, the optimizer state, the caches and the data sequence, so every variant sees the same steps."""

    name: str
    title: str
    module: nn.Module
    make_step: Callable[[Callable], Callable[[], Optional[torch.Tensor]]]
    local_options: dict
    dynamo_flags: dict
    capture_sizes: Optional[List[int]] = None  # for the "+sizes" variants (decode workloads only)
    paddable: bool = False  # the "+max" / "+buckets" variants apply (MoE workloads only)
    settle_steps: int = 3  # untimed steps between the compile calls and the timed ones
    variants: Optional[tuple] = None  # the variants that apply (None: every one asked for; refusals are rows)
    reset: Optional[Callable[[], None]] = None
    check: bool = False  # compare each step's output with eager's over the compile calls and settle steps
    check_tol: float = 1e-3  # largest |out - eager| / max |eager| that counts as agreeing
    training: bool = False  # the peak-memory goal (<= 1.3x eager) is judged on training workloads
    scoped: bool = False  # "+layer" / "+block" apply (inference_cuda_graph_scope)
    compile_kwargs: dict = dataclasses.field(default_factory=dict)  # e.g. dynamic=True for a changing batch


@dataclasses.dataclass
class Result:
    variant: str
    error: Optional[str] = None
    skipped: Optional[str] = None  # not run here, and why (needs CUDA, stage budget spent, ...)
    compile_s: Optional[float] = None
    step_ms: Optional[float] = None
    peak_mib: Optional[float] = None
    busy_ms: Optional[float] = None
    launches: Optional[float] = None  # per step; see bench_gpu.py's docstring for what is counted where
    graph_launches: Optional[float] = None
    syncs: Optional[float] = None
    profile_error: Optional[str] = None  # the profiled pass failed: its columns stay "-", the timings stand
    stats: Optional[dict] = None
    outputs: Optional[List[torch.Tensor]] = None  # the checked outputs (CPU float copies), eager's kept to compare
    out_diff: Optional[float] = None  # largest |out - eager| / max |eager| over the checked steps
    kernels: Optional[dict] = None  # {kernel: (launches, µs) per step} from the profiled pass (gpu_kernels.py)


def split_variant(name: str) -> tuple:
    """"cg-local-eager+block+sizes" -> ("cg-local-eager", ("block", "sizes"))."""
    base, *suffixes = name.split("+")
    unknown = [x for x in suffixes if x not in SUFFIXES]
    if unknown:
        raise ValueError(f"unknown variant suffix {unknown} in {name!r}; suffixes: {SUFFIXES}")
    return base, tuple(suffixes)


def variant_options(name: str, workload: Workload, driver: str) -> dict:
    """The cgcompile options of a "cg-..." variant: base (local-eager / local-inductor / full-iteration) plus
    optional suffixes: "+sizes" (capture_sizes), "+max" / "+buckets" / "+off" (dynamic_padding), "+layer" /
    "+block" (inference_cuda_graph_scope)."""
    base, suffixes = split_variant(name)
    padding = [x for x in suffixes if x in ("max", "buckets", "off")]
    if padding and not workload.paddable:
        raise ValueError("dynamic_padding rows are for the MoE workloads (decode has no data-dependent index op)")
    scope = [x for x in suffixes if x in ("layer", "block")]
    if scope and not workload.scoped:
        raise ValueError("inference scope rows are for the decode workloads")
    if base == "cg-full-iteration":
        options = {"cuda_graph_impl": "full_iteration", "driver": driver}
    elif padding and padding[0] != "off":  # every capture-safe span: the untagged expert loop is what padding frees
        options = {"cuda_graph_impl": "local", "inner_compiler": base.rsplit("-", 1)[1], "driver": driver}
    else:
        options = dict(workload.local_options, inner_compiler=base.rsplit("-", 1)[1], driver=driver)
    if "sizes" in suffixes:
        if not workload.capture_sizes:
            raise ValueError("capture_sizes rows are for the decode workloads")
        options["capture_sizes"] = workload.capture_sizes
    if padding:
        options["dynamic_padding"] = padding[0]
    if scope:
        options["inference_cuda_graph_scope"] = scope[0]
    return options


def build_variant(name: str, workload: Workload, driver: str) -> Callable:
    module = workload.module
    if name == "eager":
        return module
    if name == "inductor":
        return torch.compile(module, **workload.compile_kwargs)
    if name == "reduce-overhead":
        return torch.compile(module, mode="reduce-overhead", **workload.compile_kwargs)
    if not name.startswith("cg-"):
        raise ValueError(f"unknown variant {name!r}")
    return torch.compile(module, backend=backend(), options=variant_options(name, workload, driver),
                         **workload.compile_kwargs)


def backend():
    """"cudagraph_modules" when the entry point is registered (pip install -e .); else the backend function itself
    (a checkout on sys.path that was not installed still benchmarks)."""
    from torch._dynamo.backends.registry import list_backends

    if "cudagraph_modules" in list_backends(exclude_tags=()):
        return "cudagraph_modules"
    from cgcompile.backend import cudagraph_modules

    return cudagraph_modules


def skip_reason(name: str, cuda: bool, smoke_inductor: bool = False) -> Optional[str]:
    """Why a variant does not run here, or None. On the CPU: reduce-overhead needs CUDA; the Inductor variants
    compile C++ kernels (10-40 s each on a small CPU), so the plumbing run leaves them out unless asked."""
    base = name.split("+")[0]
    if cuda:
        return None
    if base in CUDA_ONLY:
        return CUDA_ONLY[base]
    if base in INDUCTOR_VARIANTS and not smoke_inductor:
        return "CPU smoke: Inductor's C++ compile takes 10-40 s per variant here (--smoke-inductor runs it)"
    return None


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
    """One torch.profiler pass over n steps -> cuda_counts of its events + (its per-kernel table,)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            mark_step()
            step()
        torch.cuda.synchronize()
    events = prof.events()
    return cuda_counts(events, n) + (cuda_kernel_table(events, n),)


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
    """The CPU proxy over n steps -> per step (host kernel ops, emulated graph replays, host syncs), counted as
    profiling.HostOpCounter counts them, + (the per-kernel table,): one torch.profiler pass for both."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            mark_step()
            step()
    events = prof.events()
    ops, syncs, replays = profiling.count_events(events)
    return ops / n, replays / n, syncs / n, cpu_kernel_table(events, n)


def cleanup(cuda: bool) -> None:
    """Between variants: Dynamo's caches go; on a GPU also the last variant's memory (a full collection with
    transformers loaded takes a fraction of a second: the CPU smoke run, which frees no device memory, skips it)."""
    torch._dynamo.reset()
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _keep(out) -> Optional[torch.Tensor]:
    """A CPU float copy of a step's output (a tensor, or a transformers output with .loss / .logits)."""
    if out is None:
        return None
    if not isinstance(out, torch.Tensor):
        out = getattr(out, "loss", None) if getattr(out, "loss", None) is not None else getattr(out, "logits", None)
    return None if out is None else out.detach().float().cpu().clone()


def out_diff(outputs: List[torch.Tensor], reference: List[torch.Tensor]) -> Optional[float]:
    """Largest |out - ref| / max |ref| over the steps both have (None when there is nothing to compare)."""
    diffs = [float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)
             for a, b in zip(outputs, reference) if a is not None and b is not None and a.shape == b.shape]
    return max(diffs) if diffs else None


def run_variant(name: str, workload: Workload, args, clock: Clock, eager: Optional[Result] = None) -> Result:
    """One variant of one workload: compile calls (timed together, outputs kept when workload.check), settle
    steps, timed steps, peak memory, one profiled pass; errors become the row's n/a."""
    result = Result(name)
    cleanup(clock.cuda)
    stats_fn, reset_fn = getattr(cgcompile, "stats", None), getattr(cgcompile, "reset_stats", None)
    if callable(reset_fn):
        reset_fn()
    flags = workload.dynamo_flags if name != "eager" else {}
    outputs: List[Optional[torch.Tensor]] = []
    try:
        if workload.reset is not None:
            workload.reset()
        clock.sync()
        if clock.cuda:
            torch.cuda.reset_peak_memory_stats()
            start_bytes = torch.cuda.memory_allocated()
        with torch._dynamo.config.patch(**flags):
            step = workload.make_step(build_variant(name, workload, args.driver))
            clock.sync()
            start = time.perf_counter()
            for _ in range(COMPILE_CALLS):
                mark_step()
                out = step()
                if workload.check:
                    outputs.append(_keep(out))
            clock.sync()
            result.compile_s = time.perf_counter() - start
            if workload.check:  # the settle steps replay what was captured: their outputs are checked too
                for _ in range(workload.settle_steps):
                    mark_step()
                    outputs.append(_keep(step()))
                del out
            else:
                clock.step_times_ms(step, workload.settle_steps)
            result.step_ms = statistics.median(clock.step_times_ms(step, args.steps))
            if clock.cuda:
                result.peak_mib = (torch.cuda.max_memory_allocated() - start_bytes) / 2**20
            try:  # never run on this torch/CUDA before: a profiler problem must not hide the timings
                if clock.cuda:
                    (result.busy_ms, result.launches, result.graph_launches, result.syncs,
                     result.kernels) = cuda_profile(step, args.profile_steps)
                else:
                    (result.launches, result.graph_launches, result.syncs,
                     result.kernels) = cpu_counts(step, args.profile_steps)
            except Exception as exc:
                result.profile_error = error_line(exc)
        if name.startswith("cg-") and callable(stats_fn):
            result.stats = stats_fn()
        if workload.check:
            if name == "eager":
                result.outputs = outputs
            elif eager is not None and eager.outputs:
                result.out_diff = out_diff(outputs, eager.outputs)
    except Exception as exc:  # one variant failing must not hide the others
        result.error = error_line(exc)
    finally:
        with contextlib.suppress(Exception):
            cleanup(clock.cuda)
    return result


def status_line(workload: Workload, r: Result) -> str:
    """The one-line status printed (and appended to the markdown report) as each row finishes."""
    if r.skipped:
        return f"skipped: {r.skipped}"
    if r.error:
        return f"n/a: {r.error}"
    text = f"{r.step_ms:.3f} ms/step, compile+capture {r.compile_s:.2f} s"
    if r.busy_ms is not None:
        text += f", busy {r.busy_ms:.3f} ms ({r.step_ms / r.busy_ms:.2f}x)"
    if r.peak_mib is not None:
        text += f", peak {r.peak_mib:.0f} MiB"
    if r.out_diff is not None:
        text += f", out diff vs eager {r.out_diff:.1e} ({'agrees' if r.out_diff <= workload.check_tol else 'DIFFERS'})"
    return text


def _num(value: Optional[float], fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def table_lines(workload: Workload, results: Dict[str, Result], cuda: bool) -> List[str]:
    """The workload's table: its title, a row per variant (measured, n/a: why, or skipped: why), then notes."""
    eager = results.get("eager")
    ro = results.get("reduce-overhead")
    eager_ms = eager.step_ms if eager else None
    eager_peak = eager.peak_mib if eager else None
    ro_ms = ro.step_ms if ro else None
    ro_compile = ro.compile_s if ro else None
    header = ("variant", "step ms", "speedup vs eager", "vs reduce-ovh", "compile+capture s", "/ reduce-ovh",
              "peak MiB", "peak vs eager", "GPU busy ms", "step / busy", "launches", "graph launches", "syncs",
              "out diff")
    rows = [header]
    for name, r in results.items():
        if r.skipped:
            rows.append((name, f"skipped: {r.skipped}"))
            continue
        if r.error:
            rows.append((name, f"n/a: {r.error}"))
            continue
        rows.append((name, _num(r.step_ms, ".3f"), _num(ratio(eager_ms, r.step_ms), ".2f", "x"),
                     _num(ratio(ro_ms, r.step_ms), ".2f", "x"), _num(r.compile_s, ".2f"),
                     _num(ratio(r.compile_s, ro_compile), ".2f", "x"), _num(r.peak_mib, ".0f"),
                     _num(ratio(r.peak_mib, eager_peak), ".2f", "x"),
                     _num(r.busy_ms, ".3f"), _num(ratio(r.step_ms, r.busy_ms), ".2f", "x"),
                     _num(r.launches, ".1f"), _num(r.graph_launches, ".1f"), _num(r.syncs, ".1f"),
                     _num(r.out_diff, ".1e")))
    widths = [max(len(row[i]) for row in rows if len(row) == len(header)) for i in range(len(header))]
    widths[0] = max(len(row[0]) for row in rows)
    lines = [workload.title]
    for row in rows:
        if len(row) != len(header):
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
        else:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))))
    lines.append(f"  launches / graph launches / syncs per step: {COUNT_DEFINITIONS[cuda]}")
    if workload.check:
        lines.append(f"  out diff: largest |output - eager's| / max |eager's| over the first "
                     f"{COMPILE_CALLS + workload.settle_steps} steps (agrees: <= {workload.check_tol:g})")
    for name, r in results.items():
        if r.profile_error:
            lines.append(f"  {name}: profiled pass failed ({r.profile_error}): busy and count columns are '-'")
    for name, r in results.items():
        if r.stats:
            fallbacks = r.stats.get("eager_fallbacks", [])
            lines.append(f"  {name} stats: graphs_captured={r.stats.get('graphs_captured')}, "
                         f"replays={r.stats.get('replays')}, eager_fallbacks={len(fallbacks)}"
                         + (f" (first: {fallbacks[0]})" if fallbacks else ""))
    return lines


def print_table(workload: Workload, results: Dict[str, Result], cuda: bool) -> List[str]:
    lines = table_lines(workload, results, cuda)
    print("\n" + "\n".join(lines))
    return lines


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



"""GPU benchmark: cgcompile's partial CUDA graphs against eager, Inductor and Inductor's reduce-overhead.

Realistic workloads (benchmarks/workloads_hf.py: Hugging Face Llama and Qwen3-MoE at the sizes people train and
serve, bf16, new data every step; each runs the variants that apply to it, listed in that file):
  llama-train, qwen3moe-train, qwen3moe-sync (dynamic_padding off / max / buckets), llama8b-decode-b1 / -b8 /
  -b32 (layer and block inference scope), llama8b-decode-varying (capture_sizes).
Launch-bound workloads (benchmarks/workloads_small.py), each run under every variant asked for:
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
measured ratio with verdict n/a). --kernel-diff A,B adds, after each workload, a kernel-by-kernel table of B
against A (launches and µs per step per kernel, from the same profiled steps; benchmarks/gpu_kernels.py).

The harness (variants, timing, profiling, tables) is benchmarks/gpu_harness.py, the goals gpu_goals.py; gpu_perf.py
(`make gpu-perf`) runs this script stage by stage inside one 9-minute budget.

    python benchmarks/bench_gpu.py             # on a CUDA machine; prints "skipped: no CUDA" and exits 0 elsewhere
    python benchmarks/bench_gpu.py --quick     # fewer timed steps
    python benchmarks/bench_gpu.py --models moe --variants eager,reduce-overhead,cg-local-eager
    python benchmarks/bench_gpu.py --models llama8b-decode-b1,qwen3moe-sync --markdown report.md
    python benchmarks/bench_gpu.py --cpu-smoke   # every realistic workload, tiny, every variant, on CPU (emulate)
    python benchmarks/bench_gpu.py --cpu-smoke --quick --models moe,decode   # the small ones: plumbing only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import sys
import time
import warnings
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.models
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for the harness and workloads

import torch  # noqa: E402

import workloads_hf  # noqa: E402
import workloads_small  # noqa: E402
from gpu_goals import goal_rows  # noqa: E402
from gpu_harness import (  # noqa: E402,F401  (re-exported: tests and gpu_check read them here)
    COMPILE_CALLS, COUNT_DEFINITIONS, PADDED_VARIANTS, Clock, Result, Workload, cleanup, cpu_counts, cuda_counts,
    cuda_profile, error_line, host_time_rows, mark_step, print_table, run_variant, skip_reason, split_variant,
    status_line, variant_options)
from gpu_kernels import kernel_diff_lines  # noqa: E402

VARIANTS = ("eager", "inductor", "reduce-overhead", "cg-local-eager", "cg-local-inductor", "cg-full-iteration",
            "cg-local-eager+sizes", "cg-local-inductor+sizes") + PADDED_VARIANTS
MODELS = ("moe", "moe-fixed", "mixtral", "decode", "decode-varying", "hf-mixtral", "llama8b-decode-b1",
          "qwen3moe-sync", "llama-train", "qwen3moe-train", "llama8b-decode-b8", "llama8b-decode-b32",
          "llama8b-decode-varying")
SMALL_MODELS = workloads_small.MODELS
HF_MODELS = workloads_hf.MODELS
DEFAULT_MODELS = tuple(m for m in SMALL_MODELS if not m.startswith("hf")) + HF_MODELS  # hf-mixtral: when named
assert set(MODELS) == set(SMALL_MODELS) | set(HF_MODELS)


def md_append(path: Optional[str], text: str) -> None:
    """Append to the markdown report at once (a run killed later keeps every row it measured)."""
    if path:
        with open(path, "a") as f:
            f.write(text.rstrip("\n") + "\n")


def variants_for(workload: Workload, asked: Optional[List[str]]) -> List[str]:
    """The variants to run on a workload, eager first (the rows compare with it), then in the order asked: the
    workload's own list (HF workloads) narrowed to those asked for, or everything asked for (small workloads:
    refusals are rows)."""
    if workload.variants is not None:
        names = list(workload.variants) if asked is None else [v for v in asked if v in workload.variants]
    else:
        names = list(asked if asked is not None else VARIANTS)
    return [v for v in names if v == "eager"] + [v for v in names if v != "eager"]


def build_workload(name: str, args, device, dtype, smoke: bool) -> Workload:
    if name in HF_MODELS:
        return workloads_hf.build(name, smoke, device, dtype, layers=args.hf_layers)
    return workloads_small.BUILDERS[name](args, device, dtype)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed and profiled steps")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated: {', '.join(MODELS)} (default: all but hf-mixtral on CUDA; "
                             f"the realistic ones with --cpu-smoke)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated (default: each realistic workload's own list; every variant for the "
                             f"small ones): {', '.join(VARIANTS)}, or a base with +suffixes "
                             "(+sizes +max +buckets +off +layer +block)")
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
    parser.add_argument("--driver", default=None,
                        help="cgcompile driver: auto | cuda | emulate | eager (default auto; emulate with --cpu-smoke)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run the harness on CPU with tiny float32 models (checks plumbing; numbers meaningless)")
    parser.add_argument("--smoke-inductor", action="store_true",
                        help="--cpu-smoke: also run the Inductor variants (C++ compiles: minutes)")
    parser.add_argument("--markdown", default=None, help="append each row, each table and the goals to this file")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="a time budget: variants that would start after it are skipped (rows say so)")
    parser.add_argument("--inductor-cache", action="store_true",
                        help="keep Inductor's caches (TORCHINDUCTOR_CACHE_DIR); default: disabled, cold compiles")
    parser.add_argument("--hf-layers", type=int, default=None,
                        help="realistic workloads: this many layers instead of their own (a time budget's compromise)")
    parser.add_argument("--no-host-time", action="store_true", help="skip the host-time-per-replay rows")
    parser.add_argument("--kernel-diff", default=None, metavar="A,B",
                        help="after each workload, a kernel-by-kernel table of variant B against variant A "
                             "(e.g. reduce-overhead,cg-local-inductor), from the profiled pass")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    deadline = started + args.deadline_s if args.deadline_s else None
    asked = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    models = ([m.strip() for m in args.models.split(",") if m.strip()] if args.models else
              list(HF_MODELS if args.cpu_smoke else DEFAULT_MODELS))
    unknown = [m for m in models if m not in MODELS]
    diff = [v.strip() for v in args.kernel_diff.split(",")] if args.kernel_diff else None
    if diff is not None and len(diff) != 2:
        parser.error("--kernel-diff takes two variant names: A,B")
    for v in (asked or []) + (diff or []):
        try:
            base, _ = split_variant(v)
            if base not in ("eager", "inductor", "reduce-overhead", "cg-local-eager", "cg-local-inductor",
                            "cg-full-iteration"):
                unknown.append(v)
        except ValueError:
            unknown.append(v)
    if unknown:
        parser.error(f"unknown variant or model {unknown}; variants: {VARIANTS}; models: {MODELS}")
    if args.token_pool < 1:
        parser.error("--token-pool must be >= 1")
    args.steps = args.steps or (3 if args.cpu_smoke else 20 if args.quick else 100)
    args.profile_steps = args.profile_steps or (1 if args.cpu_smoke else 3 if args.quick else 10)
    args.driver = args.driver or ("emulate" if args.cpu_smoke else "auto")

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
    if not args.inductor_cache:
        torch._inductor.config.force_disable_caches = True  # cold compile times for every compiled variant
        warnings.filterwarnings("ignore", message=".*force_disable_caches.*")
    cache = (f"Inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default dir')}" if args.inductor_cache
             else "Inductor caches disabled")
    print(f"timed steps {args.steps} (median), profiled steps {args.profile_steps}, compile+capture = first "
          f"{COMPILE_CALLS} calls, cgcompile driver={args.driver}; {cache}", flush=True)

    if not cuda:  # the plumbing run: what is loaded now (torch, transformers) stays out of every gc pass
        with contextlib.suppress(ImportError):
            import transformers  # noqa: F401
        gc.freeze()
    clock = Clock(cuda)
    all_results: Dict[str, Dict[str, Result]] = {}
    for model_name in models:
        if deadline is not None and time.perf_counter() > deadline:
            print(f"\n{model_name}: skipped: time budget spent", flush=True)
            md_append(args.markdown, f"- `{model_name}`: skipped: time budget spent")
            continue
        try:
            workload = build_workload(model_name, args, device, dtype, smoke=not cuda)
        except Exception as exc:
            print(f"\n{model_name}: n/a: {error_line(exc)}", flush=True)
            md_append(args.markdown, f"- `{model_name}`: n/a: {error_line(exc)}")
            cleanup(cuda)
            continue
        try:  # CUDA context, cuBLAS handles, lazy imports: paid once here, not by whichever variant runs first
            if workload.reset is not None:
                workload.reset()
            warm = workload.make_step(workload.module)
            for _ in range(3):
                mark_step()  # its first call imports cudagraph_trees
                warm()
            clock.sync()
        except Exception as exc:
            print(f"\n{model_name}: n/a: eager warmup failed: {error_line(exc)}", flush=True)
            md_append(args.markdown, f"- `{model_name}`: n/a: eager warmup failed: {error_line(exc)}")
            del workload
            cleanup(cuda)
            continue
        md_append(args.markdown, f"\n### {workload.title}\n")
        results: Dict[str, Result] = {}
        for variant in variants_for(workload, asked):
            why = skip_reason(variant, cuda, args.smoke_inductor)
            if why is None and deadline is not None and time.perf_counter() > deadline:
                why = "time budget spent"
            r = Result(variant, skipped=why) if why else run_variant(variant, workload, args, clock,
                                                                     eager=results.get("eager"))
            results[variant] = r
            print(f"  [{model_name}] {variant}: {status_line(workload, r)}", flush=True)
            md_append(args.markdown, f"- `{variant}`: {status_line(workload, r)}")
        all_results[model_name] = results
        lines = print_table(workload, results, cuda)
        md_append(args.markdown, "\n```text\n" + "\n".join(lines) + "\n```")
        if diff is not None:
            lines = kernel_diff_lines(model_name, results, *diff, cuda)
            print("\n" + "\n".join(lines), flush=True)
            md_append(args.markdown, "\n" + "\n".join(lines))
        del workload, results, warm
        cleanup(cuda)

    if "decode" in models and not args.no_host_time:
        host_time_rows(device if cuda else "cpu", args.quick)
    rows = goal_rows(all_results, judged=cuda)
    if rows:
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        title = "goals" + ("" if cuda else " (CPU smoke: ratios shown, not judged)")
        lines = [f"  {text.ljust(widths[0])}  {value.rjust(widths[1])}  {verdict}" for text, value, verdict in rows]
        print(f"\n{title}\n" + "\n".join(lines))
        md_append(args.markdown, f"\n{title}:\n\n```text\n" + "\n".join(lines) + "\n```")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

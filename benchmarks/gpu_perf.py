"""One command for a fresh GPU machine without network: every GPU benchmark row of issue 37 in one 9-minute call.

    python benchmarks/gpu_perf.py                 # or: make gpu-perf; output under $OUT if set, else gpu-perf-out/
    python benchmarks/gpu_perf.py --plan          # print the stage plan and exit (what it does without CUDA)

Stages run in order, the fastest and most informative rows first, each in its own process group with its own time
limit (killed with its children past it) inside one overall budget (--budget, 510 s: a 9-minute call with room
for the machine's start). Inside a stage, bench_gpu.py runs the variants in the order listed and skips those
that would start after the stage's budget (the row says so): eager, then the pair issue 36 compares
(reduce-overhead and cg-local-inductor, cold Inductor compiles), then cgcompile's other rows (2026-11-28: with
the pair last, the 65-75 s stages skipped them). Every row is printed and appended to one
markdown file as it finishes, so a run killed at any point keeps what it measured; the device, torch, CUDA,
git commit and date are at the top of that file, every stage's full output in <out>/gpu-perf.log (two files in
all: a lent machine's $OUT brings back only a few).
Inductor's compile cache lives in <out>/inductor-cache (TORCHINDUCTOR_CACHE_DIR, kept: a second run on the same
machine compiles warm), except under $OUT, where thousands of cache files would crowd out the report: then in
$TMPDIR/cgcompile-inductor-cache (--cache-dir chooses); compiles use parallel workers
(TORCHINDUCTOR_COMPILE_THREADS = the CPU count).
The install stage is `pip install --no-deps --no-build-isolation -e .` (the machine's torch is kept; offline).
Goals, judged in the output: padded MoE (qwen3moe-sync, dynamic_padding max / buckets) >= 3x eager and >= 2x
reduce-overhead; peak memory <= 1.3x eager on the training workloads; decode within 1.1x of its GPU-busy time.
Where a stage runs both reduce-overhead and cg-local-inductor (decode-b1, moe-sync, llama-train, moe-train), it
also prints their kernel-by-kernel table (bench_gpu.py --kernel-diff, gpu_kernels.py; issue 36): any gap named.
Without CUDA it prints its stage plan and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 510
REPORT = "gpu-perf.md"
LOG = "gpu-perf.log"
CG_DECODE = "cg-local-eager+block,cg-local-eager+layer,cg-full-iteration"
SLOW = "reduce-overhead,inductor"  # cold Inductor compiles of a whole model: after cgcompile's rows
INDUCTOR_DIFF = "reduce-overhead,cg-local-inductor"  # issue 36: any gap between the two, named kernel by kernel


@dataclasses.dataclass
class Stage:
    name: str
    limit_s: float  # this stage's own budget; bench_gpu.py gets a deadline a little inside it
    models: str = ""  # bench_gpu.py --models (empty: a command of its own)
    variants: str = ""
    argv: Optional[List[str]] = None  # a command other than bench_gpu.py
    extra: tuple = ()  # more bench_gpu.py arguments
    kernel_diff: str = ""  # bench_gpu.py --kernel-diff A,B: the two variants' kernel-by-kernel table (issue 36)
    why: str = ""  # what the stage is for, in the plan

    def command(self, python: str, report: str) -> List[str]:
        if self.argv is not None:
            return [python if a == "{python}" else a for a in self.argv]
        return [python, "benchmarks/bench_gpu.py", "--quick", "--models", self.models, "--variants", self.variants,
                "--markdown", report, "--deadline-s", f"{max(self.limit_s - 25, 10):.0f}", "--inductor-cache",
                "--no-host-time", *(("--kernel-diff", self.kernel_diff) if self.kernel_diff else ()),
                *self.extra]


def stages() -> List[Stage]:
    """The plan, in order. Budgets add up to BUDGET_S."""
    return [
        Stage("install", 30, argv=["{python}", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                                   "-e", "."], why="the backend's entry point; torch untouched, no network"),
        Stage("decode-b1", 70, "llama8b-decode-b1", f"eager,reduce-overhead,cg-local-inductor+block,{CG_DECODE}",
              kernel_diff="reduce-overhead,cg-local-inductor+block",
              why="8B-shaped decode, batch 1: launch-bound; goal within 1.1x of GPU-busy"),
        Stage("moe-sync", 80, "qwen3moe-sync",
              "eager,cg-local-eager+buckets,reduce-overhead,cg-local-inductor+buckets,cg-local-eager+max,"
              "cg-full-iteration+max,cg-local-eager+off,inductor", extra=("--hf-layers", "2"),
              kernel_diff="reduce-overhead,cg-local-inductor+buckets",
              why="64-expert MoE with per-expert nonzero, 2 of its 8 layers (Dynamo unrolls the 64-expert loop: "
                  "8 s of tracing per layer on a 2-core CPU, per variant): padded goals >= 3x eager, "
                  ">= 2x reduce-overhead"),
        Stage("llama-train", 125, "llama-train", "eager,reduce-overhead,cg-local-inductor,cg-local-eager,"
                                                "cg-full-iteration,inductor",
              kernel_diff=INDUCTOR_DIFF, why="1B-class dense training step with AdamW: peak memory <= 1.3x eager"),
        Stage("moe-train", 95, "qwen3moe-train", "eager,reduce-overhead,cg-local-inductor,cg-local-eager,"
                                                 "cg-full-iteration,inductor",
              kernel_diff=INDUCTOR_DIFF, why="64-expert MoE with grouped_mm experts: peak memory <= 1.3x eager"),
        Stage("decode-b8-b32", 50, "llama8b-decode-b8,llama8b-decode-b32", f"eager,{CG_DECODE},reduce-overhead",
              why="decode at batch 8 and 32: within 1.1x of GPU-busy"),
        Stage("decode-varying", 35, "llama8b-decode-varying",
              "eager,cg-local-eager+block+sizes,cg-local-eager+block,reduce-overhead",
              why="a batch that changes every step: capture_sizes against one graph per size"),
        Stage("small", 25, "moe,decode", "eager,cg-local-eager,cg-local-eager+max,cg-full-iteration,reduce-overhead",
              why="the launch-bound toys (d=512, 8 layers): where launch overhead shows"),
    ]


def out_dir(arg: Optional[str]) -> str:
    return os.path.abspath(arg or os.environ.get("OUT") or os.path.join(ROOT, "gpu-perf-out"))


def header_lines(cuda: bool = True) -> List[str]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True)
    device = (f"- device: {torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible), "
              f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB" if cuda else
              "- device: CPU (--cpu-plumbing: bench_gpu.py --cpu-smoke in every stage; numbers meaningless)")
    return [device,
            f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {sys.version.split()[0]}",
            f"- commit: {commit.stdout.strip() or 'unknown'}{' (with local changes)' if dirty.stdout.strip() else ''}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}"]


def append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text.rstrip("\n") + "\n")


def cache_dir(arg: Optional[str], out: str, explicit_out: bool) -> str:
    if arg:
        return os.path.abspath(arg)
    if os.environ.get("OUT") and not explicit_out:
        return os.path.join(os.environ.get("TMPDIR", "/tmp"), "cgcompile-inductor-cache")
    return os.path.join(out, "inductor-cache")


def run_stage(argv: List[str], limit_s: float, log_path: str, env: dict) -> str:
    """Run argv in its own process group, its output echoed line by line and appended to log_path; past limit_s
    the whole group is killed. Returns the status."""
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(argv)}  (limit {limit_s:.0f} s)\n")
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1)
        killed = threading.Event()

        def kill():
            killed.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(limit_s, kill)
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                if not line.startswith("USDT:"):  # the profiler's start/stop notes
                    print(line, end="", flush=True)
            rc = proc.wait()
        finally:
            timer.cancel()
    if killed.is_set():
        return f"killed at its limit of {limit_s:.0f} s (rows measured before are kept)"
    return "ok" if rc == 0 else f"failed (exit {rc})"


def print_plan(budget_s: float, out: str, plan: List[Stage]) -> None:
    print(f"gpu-perf: the stage plan ({budget_s:.0f} s in all; output to {out}/{REPORT} and {LOG}):")
    for stage in plan:
        argv = stage.command("python", f"{out}/{REPORT}")
        print(f"  {stage.name:<15} {stage.limit_s:>4.0f} s  {stage.why}\n                         {' '.join(argv)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default: $OUT, else gpu-perf-out/)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all stages together")
    parser.add_argument("--plan", action="store_true", help="print the stage plan and exit")
    parser.add_argument("--skip-install", action="store_true", help="leave out the install stage")
    parser.add_argument("--cache-dir", default=None, help="Inductor's cache (default: see above)")
    parser.add_argument("--stages", default=None, help="comma-separated stage names to run (default: all)")
    parser.add_argument("--cpu-plumbing", action="store_true",
                        help="check this script on a CPU: the stages run bench_gpu.py --cpu-smoke, no install")
    args = parser.parse_args(argv)
    plan = [s for s in stages() if args.stages is None or s.name in args.stages.split(",")]
    unknown = sorted(set(args.stages.split(",")) - {s.name for s in stages()}) if args.stages else []
    if unknown:
        parser.error(f"unknown stage(s) {unknown}; valid: {[s.name for s in stages()]}")
    if args.cpu_plumbing:
        plan = [dataclasses.replace(s, extra=s.extra + ("--cpu-smoke",)) for s in plan if s.name != "install"]
    started = time.monotonic()
    out = out_dir(args.out)
    try:
        import torch
        cuda, why = torch.cuda.is_available(), f"torch {torch.__version__}: torch.cuda.is_available() is False"
    except ImportError as exc:
        cuda, why = False, f"torch cannot be imported ({exc})"
    if args.plan or not (cuda or args.cpu_plumbing):
        if not cuda:
            print(f"gpu-perf: no CUDA device ({why}); nothing was run.")
        print_plan(args.budget, out, plan)
        return 0
    os.makedirs(out, exist_ok=True)
    report, log = os.path.join(out, REPORT), os.path.join(out, LOG)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TORCHINDUCTOR_CACHE_DIR=cache_dir(args.cache_dir, out, args.out is not None),
               TORCHINDUCTOR_COMPILE_THREADS=str(os.cpu_count() or 8),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    head = ["", f"# cgcompile GPU perf ({REPORT})", "", *header_lines(cuda and not args.cpu_plumbing),
            f"- budget {args.budget:.0f} s; Inductor cache {env['TORCHINDUCTOR_CACHE_DIR']}, "
            f"{env['TORCHINDUCTOR_COMPILE_THREADS']} compile threads", ""]
    append(report, "\n".join(head))
    print("\n".join(head), flush=True)
    deadline = started + args.budget
    summary = []
    for stage in plan:
        if stage.name == "install" and args.skip_install:
            continue
        left = deadline - time.monotonic()
        if left < 15:
            summary.append((stage.name, "not run: overall budget used", 0.0))
            append(report, f"\n## {stage.name}: not run (overall budget used)")
            continue
        limit = min(stage.limit_s, left)
        stage = dataclasses.replace(stage, limit_s=limit)
        argv = stage.command(sys.executable, report)
        append(report, f"\n## {stage.name} (limit {limit:.0f} s): {stage.why}\n\n`{' '.join(argv[1:])}`")
        print(f"\ngpu-perf: {stage.name} (limit {limit:.0f} s)", flush=True)
        t0 = time.monotonic()
        status = run_stage(argv, limit, log, env)
        seconds = time.monotonic() - t0
        summary.append((stage.name, status, seconds))
        append(report, f"\nstage {stage.name}: {status} in {seconds:.0f} s")
        print(f"gpu-perf: {stage.name}: {status} in {seconds:.0f} s", flush=True)
    table = ["", "## stages", "", "| stage | result | seconds |", "|---|---|---|"]
    table += [f"| {name} | {status} | {seconds:.0f} |" for name, status, seconds in summary]
    table += ["", f"total {time.monotonic() - started:.0f} s; goals: the `goals` block after each stage"]
    append(report, "\n".join(table))
    print("\n".join(table) + f"\ngpu-perf: report {report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

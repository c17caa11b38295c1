"""One command for a GPU machine: install, run the GPU tests and the held GPU benchmarks, write one markdown report.

    python benchmarks/gpu_check.py --report gpu-check.md     # or: make gpu-check REPORT=gpu-check.md

Stages (STAGES below; add one by appending a Stage), in order, each in its own process group with a time limit
(killed, with every child, when it runs over) and all of them inside one overall budget (BUDGET_S) so the run
ends within 8 minutes on an H100:
  install      pip install --no-deps --no-build-isolation -e . into the Python running this script (the
               machine's torch is kept), plus the missing test packages
  gpu-tests    pytest tests/gpu except the NCCL file, per-test timeout (pytest-timeout)
  bench-*      benchmarks/bench_gpu.py --quick: MoE with new tokens every step, KV-cache decode, and Hugging
               Face rows when bench_gpu.py offers a model whose name starts with "hf"
  gpu-nccl     pytest tests/gpu/test_gpu_distributed.py alone and last: its process-group teardown has been seen
               to hang (the stage limit then kills it; the test results printed before still count)
The report (device, torch, CUDA, date, each test's result, each benchmark's ms/step and goals, stage times) goes
to --report; every stage's full output goes to <report stem>.logs/. Without CUDA it prints what it would run and
exits 2 without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from typing import Callable, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 450  # all stages together; leaves margin under 8 minutes for startup and the report
TEST_TIMEOUT_S = 120  # per test (pytest-timeout); a module's own timeout mark takes precedence
TEST_PACKAGES = {"pytest": "pytest", "pytest_timeout": "pytest-timeout", "expecttest": "expecttest",
                 "hypothesis": "hypothesis", "numpy": "numpy"}  # import name -> pip name (pyproject's test extra)
NCCL_TESTS = "tests/gpu/test_gpu_distributed.py"
NO_CUDA_EXIT = 2


@dataclasses.dataclass
class Stage:
    """One step of the check: a command, its own time limit, and how to read its output into report lines."""

    name: str
    argv: List[str]
    timeout_s: float
    summarize: Callable[[str], List[str]]


@dataclasses.dataclass
class Outcome:
    stage: Stage
    status: str  # "ok", "failed (exit N)", "timed out after N s", "not run: ..."
    seconds: float
    output: str
    lines: List[str]


def missing_test_packages() -> List[str]:
    return [pip for module, pip in TEST_PACKAGES.items() if importlib.util.find_spec(module) is None]


def install_argv(python: str) -> List[str]:
    command = f"{python} -m pip install -q --no-deps --no-build-isolation -e ."
    missing = missing_test_packages()
    if missing:  # none of them depends on torch, so the machine's torch stays
        command += f" && {python} -m pip install -q " + " ".join(missing)
    return ["bash", "-c", command]


def pytest_argv(python: str, *paths: str, ignore: Optional[str] = None) -> List[str]:
    argv = [python, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--timeout={TEST_TIMEOUT_S}", *paths]
    return argv + ([f"--ignore={ignore}"] if ignore else [])


def bench_argv(python: str, models: str, variants: str) -> List[str]:
    return [python, "benchmarks/bench_gpu.py", "--quick", "--models", models, "--variants", variants]


def bench_models() -> tuple:
    """The workloads bench_gpu.py offers (its MODELS), read without importing torch-heavy code."""
    source = open(os.path.join(ROOT, "benchmarks", "bench_gpu.py")).read()
    found = re.search(r"^MODELS = \((.*?)\)", source, re.M | re.S)
    return tuple(re.findall(r'"([^"]+)"', found.group(1))) if found else ()


# ---- reading stage output -----------------------------------------------------------------------------------

TEST_LINE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
PYTEST_TOTAL = re.compile(r"^=+ (.*(?:passed|failed|error|skipped|deselected|no tests ran).*) in [\d.]+s")
BENCH_ROW = re.compile(r"^\s*\[(\S+)\] (\S+): (.*)$")  # "  [moe] eager: 96.8 ms/step, compile+capture 0.1 s"
BENCH_NA = re.compile(r"^\S+: n/a: ")  # a workload bench_gpu.py could not build


def summarize_tests(output: str) -> List[str]:
    """One line per test (`name: OUTCOME`, the outcome first seen: a teardown ERROR after PASSED is kept too),
    then pytest's own total."""
    lines, seen = [], set()
    for line in output.splitlines():
        hit = TEST_LINE.match(line)
        if hit and (hit.group(1), hit.group(2)) not in seen:
            seen.add((hit.group(1), hit.group(2)))
            lines.append(f"{hit.group(1)}: {hit.group(2)}")
        total = PYTEST_TOTAL.match(line)
        if total:
            lines.append(f"total: {total.group(1)}")
    return lines


def summarize_bench(output: str) -> List[str]:
    """The device line, each variant's `[model] variant: ms/step` line, and the goals bench_gpu.py judged."""
    lines, in_goals = [], False
    for line in output.splitlines():
        if line.startswith(("device:", "skipped:")):
            lines.append(line.strip())
        elif BENCH_ROW.match(line) or BENCH_NA.match(line):
            lines.append(line.strip())
        elif line.startswith("goals"):
            in_goals = True
            lines.append("goals:")
        elif in_goals and line.startswith("  "):
            lines.append(line.strip())
        elif in_goals:
            in_goals = False
    return lines


def summarize_tail(output: str) -> List[str]:
    return [line for line in output.splitlines()[-5:] if line.strip()]


def stages(python: str) -> List[Stage]:
    """The check, in order. Extend here: a Stage with its command, time limit and summarizer."""
    result = [
        Stage("install", install_argv(python), 120, summarize_tail),
        Stage("gpu-tests", pytest_argv(python, "tests/gpu", ignore=NCCL_TESTS), 200, summarize_tests),
        Stage("bench-moe", bench_argv(python, "moe", "eager,reduce-overhead,cg-local-eager"), 120, summarize_bench),
        Stage("bench-decode", bench_argv(python, "decode", "eager,reduce-overhead,cg-local-eager,cg-full-iteration"),
              90, summarize_bench),
    ]
    hf = [m for m in bench_models() if m.startswith("hf")]
    if hf:
        result.append(Stage("bench-hf", bench_argv(python, ",".join(hf), "eager,reduce-overhead,cg-local-eager"),
                            120, summarize_bench))
    # last: its process-group teardown has hung before; the stage limit then kills it
    result.append(Stage("gpu-nccl", pytest_argv(python, NCCL_TESTS), 100, summarize_tests))
    return result


# ---- running ------------------------------------------------------------------------------------------------

def run_stage(stage: Stage, limit_s: float, log_path: str) -> Outcome:
    """Run the stage in its own process group; past limit_s the whole group is killed (SIGKILL)."""
    started = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w+") as log:
        log.write(f"$ {' '.join(stage.argv)}  (limit {limit_s:.0f} s)\n")
        log.flush()
        proc = subprocess.Popen(stage.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out after {limit_s:.0f} s (killed)"
        log.seek(0)
        output = log.read().split("\n", 1)[1]  # the command's own output, without the "$ ..." header
    return Outcome(stage, status, time.monotonic() - started, output, stage.summarize(output))


def run_all(plan: List[Stage], budget_s: float, log_dir: str) -> List[Outcome]:
    """Every stage within its own limit and what is left of the budget; a stage after an install failure or with
    under 10 s of budget left is not run."""
    deadline = time.monotonic() + budget_s
    outcomes: List[Outcome] = []
    for stage in plan:
        left = deadline - time.monotonic()
        if outcomes and outcomes[0].stage.name == "install" and outcomes[0].status != "ok":
            outcomes.append(Outcome(stage, "not run: install failed", 0.0, "", []))
            continue
        if left < 10:
            outcomes.append(Outcome(stage, f"not run: overall budget of {budget_s:.0f} s used", 0.0, "", []))
            continue
        print(f"gpu-check: {stage.name} (limit {min(stage.timeout_s, left):.0f} s) ...", flush=True)
        outcome = run_stage(stage, min(stage.timeout_s, left), os.path.join(log_dir, f"{stage.name}.log"))
        print(f"gpu-check: {stage.name}: {outcome.status} in {outcome.seconds:.0f} s", flush=True)
        outcomes.append(outcome)
    return outcomes


# ---- report -------------------------------------------------------------------------------------------------

def machine_lines() -> List[str]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return [f"- device: {torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible)",
            f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {sys.version.split()[0]}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
            f"- commit: {commit.stdout.strip() or 'unknown'}"]


def report_text(header: List[str], outcomes: List[Outcome], total_s: float, log_dir: str) -> str:
    out = ["# cgcompile GPU check", "", *header, f"- total: {total_s:.0f} s (budget {BUDGET_S} s)",
           f"- full logs: {log_dir}", "", "| stage | result | seconds |", "|---|---|---|"]
    out += [f"| {o.stage.name} | {o.status} | {o.seconds:.0f} |" for o in outcomes]
    for o in outcomes:
        out += ["", f"## {o.stage.name}: {o.status}", "", f"`{' '.join(o.stage.argv)}`", ""]
        out += [f"- {line}" for line in o.lines] or ["- (nothing to report)"]
        if o.status != "ok" and o.output:
            tail = o.output.splitlines()[-30:]
            out += ["", "last lines of output:", "", "```", *tail, "```"]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True, help="markdown report to write")
    args = parser.parse_args(argv)
    plan = stages(sys.executable)
    try:
        import torch
        cuda = torch.cuda.is_available()
        why = f"torch {torch.__version__}: torch.cuda.is_available() is False"
    except ImportError as exc:
        cuda, why = False, f"torch cannot be imported ({exc})"
    if not cuda:
        print(f"gpu-check: no CUDA device ({why}); nothing was run and no report written. On a CUDA machine it "
              f"would run, in {BUDGET_S} s at most:")
        for stage in plan:
            print(f"  {stage.name} (limit {stage.timeout_s:.0f} s): {' '.join(stage.argv)}")
        return NO_CUDA_EXIT
    log_dir = os.path.splitext(os.path.abspath(args.report))[0] + ".logs"
    os.makedirs(log_dir, exist_ok=True)
    started = time.monotonic()
    outcomes = run_all(plan, BUDGET_S, log_dir)
    text = report_text(machine_lines(), outcomes, time.monotonic() - started, log_dir)
    with open(args.report, "w") as f:
        f.write(text)
    print(f"gpu-check: report written to {args.report}")
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

"""One command for a GPU machine: install, run the GPU tests and the held GPU benchmarks, write one markdown report.

    python benchmarks/gpu_check.py --report gpu-check.md     # or: make gpu-check REPORT=gpu-check.md

    python benchmarks/gpu_check.py --report gpu-check.md --wheels DIR   # offline: or make gpu-check WHEELS=DIR

Stages (stages() below; add one by appending a Stage), in order, each in its own process group with a time limit
(killed, with every child, when it runs over) and all of them inside one overall budget (BUDGET_S) so the run
ends within 8 minutes on an H100:
  install      pip install --no-deps --no-build-isolation -e . into the Python running this script (the
               machine's torch is kept), then each missing test package on its own: one that cannot be
               installed (offline, no wheel for it) is reported and skipped, it fails nothing. With --wheels
               every pip call is offline: --no-index --find-links DIR. Only a failed project install stops
               the later stages.
  gpu-tests    pytest tests/gpu except the NCCL file, --continue-on-collection-errors (a module that cannot
               be imported is reported, the others run), per-test timeout when pytest-timeout is installed
  gpu-nccl     pytest tests/gpu/test_gpu_distributed.py alone, before the long benchmarks: its process-group
               teardown has been seen to hang (the stage limit then kills it; the results printed before count)
  bench-*      benchmarks/bench_gpu.py --quick: KV-cache decode, Hugging Face rows when bench_gpu.py offers a
               model whose name starts with "hf", then MoE with new tokens every step (last: its reduce-overhead
               row's cold compile is the longest). cgcompile's rows run first, then eager, then reduce-overhead
Commands that depend on what the install stage installed (pytest's plugins) are built when their stage starts.
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
import shlex
from typing import Callable, List, Optional, Sequence, Union

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 450  # all stages together; leaves margin under 8 minutes for startup and the report
TEST_TIMEOUT_S = 120  # per test (pytest-timeout); a module's own timeout mark takes precedence
TEST_PACKAGES = {"pytest": "pytest", "pytest_timeout": "pytest-timeout", "expecttest": "expecttest",
                 "hypothesis": "hypothesis", "numpy": "numpy"}  # import name -> pip name (pyproject's test extra)
NCCL_TESTS = "tests/gpu/test_gpu_distributed.py"
NO_CUDA_EXIT = 2
CG_FIRST = "cg-local-eager"  # cgcompile's own row runs before the baselines in every benchmark stage


@dataclasses.dataclass
class Stage:
    """One step of the check: a command, its own time limit, and how to read its output into report lines."""

    name: str
    argv: Union[List[str], Callable[[], List[str]]]  # a callable is built when the stage starts (after install)
    timeout_s: float
    summarize: Callable[[str], List[str]]
    required: bool = False  # when it fails, the later stages are not run (the project install)

    def command(self) -> List[str]:
        return list(self.argv()) if callable(self.argv) else list(self.argv)


@dataclasses.dataclass
class Outcome:
    stage: Stage
    status: str  # "ok", "failed (exit N)", "timed out after N s", "not run: ..."
    seconds: float
    output: str
    lines: List[str]
    argv: Optional[List[str]] = None  # what ran (None: not run)


def have(module: str) -> bool:
    """Is `module` importable by this Python now (after the install stage, too)?"""
    importlib.invalidate_caches()
    return importlib.util.find_spec(module) is not None


def missing_test_packages() -> List[str]:
    return [pip for module, pip in TEST_PACKAGES.items() if not have(module)]


def pip_install(python: str, wheels: Optional[str]) -> str:
    """The pip install command line; offline from `wheels` (a folder of wheels) when given."""
    offline = f" --no-index --find-links {shlex.quote(wheels)}" if wheels else ""
    return f"{python} -m pip install -q{offline}"


def optional_installs(python: str, packages: Sequence[str], wheels: Optional[str]) -> List[str]:
    """One command per package that never fails: a package pip cannot install (offline, no wheel) is reported,
    and only the tests needing it skip or fail to collect."""
    return [f"{{ {pip_install(python, wheels)} {shlex.quote(p)} || echo 'gpu-check: test package {p} not "
            f"installed ({'no wheel in ' + wheels if wheels else 'pip failed'}): the tests that need it do not run'; }}"
            for p in packages]


def install_argv(python: str, wheels: Optional[str] = None) -> List[str]:
    # none of the test packages depends on torch, so the machine's torch stays
    lines = [f"{pip_install(python, wheels)} --no-deps --no-build-isolation -e ."]
    lines += optional_installs(python, missing_test_packages(), wheels)
    return ["bash", "-c", " && ".join(lines)]


def pytest_argv(python: str, *paths: str, ignore: Optional[str] = None, timeout: bool = True) -> List[str]:
    """pytest -v over `paths`; a module that fails to import is reported and the others still run; a per-test time
    limit when pytest-timeout is there (`timeout`; without it, `--timeout` would be a usage error)."""
    argv = [python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    argv += [f"--timeout={TEST_TIMEOUT_S}"] if timeout else []
    return argv + list(paths) + ([f"--ignore={ignore}"] if ignore else [])


def pytest_stage_argv(python: str, *paths: str, ignore: Optional[str] = None) -> Callable[[], List[str]]:
    """pytest_argv, built when the stage starts: whether pytest-timeout is there is known only after install."""
    return lambda: pytest_argv(python, *paths, ignore=ignore, timeout=have("pytest_timeout"))


def bench_argv(python: str, models: str, variants: str) -> List[str]:
    """bench_gpu.py --quick; cgcompile's row first (CG_FIRST), the others in the order given."""
    names = [v for v in variants.split(",") if v]
    ordered = [v for v in names if v == CG_FIRST] + [v for v in names if v != CG_FIRST]
    return [python, "benchmarks/bench_gpu.py", "--quick", "--models", models, "--variants", ",".join(ordered)]


def bench_models() -> tuple:
    """The workloads bench_gpu.py offers (its MODELS), read without importing torch-heavy code."""
    source = open(os.path.join(ROOT, "benchmarks", "bench_gpu.py")).read()
    found = re.search(r"^MODELS = \((.*?)\)", source, re.M | re.S)
    return tuple(re.findall(r'"([^"]+)"', found.group(1))) if found else ()


# ---- reading stage output -----------------------------------------------------------------------------------

TEST_LINE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
COLLECT_ERROR = re.compile(r"^ERROR (\S+\.py)(?: - (.*))?$")  # pytest's short summary: a module that did not import
COLLECT_SECTION = re.compile(r"^_+ ERROR collecting (\S+) _+$")  # its traceback; the first "E   " line says why
PYTEST_TOTAL = re.compile(r"^=+ (.*(?:passed|failed|error|skipped|deselected|no tests ran).*) in [\d.]+s")
BENCH_ROW = re.compile(r"^\s*\[(\S+)\] (\S+): (.*)$")  # "  [moe] eager: 96.8 ms/step, compile+capture 0.1 s"
BENCH_NA = re.compile(r"^\S+: n/a: ")  # a workload bench_gpu.py could not build


def summarize_tests(output: str) -> List[str]:
    """One line per test (`name: OUTCOME`, the outcome first seen: a teardown ERROR after PASSED is kept too),
    one per module that could not be collected (with pytest's reason), then pytest's own total."""
    lines, seen = [], set()
    why, section = {}, None
    for line in output.splitlines():
        opened = COLLECT_SECTION.match(line)
        if opened:
            section = opened.group(1)
        elif section and line.startswith("E   ") and section not in why:
            why[section] = line[4:].strip()
        hit = TEST_LINE.match(line)
        if hit and (hit.group(1), hit.group(2)) not in seen:
            seen.add((hit.group(1), hit.group(2)))
            lines.append(f"{hit.group(1)}: {hit.group(2)}")
        broken = COLLECT_ERROR.match(line)
        if broken and broken.group(1) not in seen:
            seen.add(broken.group(1))
            reason = broken.group(2) or why.get(broken.group(1), "see the log")
            lines.append(f"{broken.group(1)}: not collected ({reason})")
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


def summarize_install(output: str) -> List[str]:
    """What gpu-check itself said (test packages it could not install), then the last lines of pip's output."""
    said = [line for line in output.splitlines() if line.startswith("gpu-check:")]
    return said + [line for line in summarize_tail(output) if line not in said]


def stages(python: str, wheels: Optional[str] = None) -> List[Stage]:
    """The check, in order. Extend here: a Stage with its command, time limit and summarizer."""
    result = [
        Stage("install", install_argv(python, wheels), 120, summarize_install, required=True),
        Stage("gpu-tests", pytest_stage_argv(python, "tests/gpu", ignore=NCCL_TESTS), 200, summarize_tests),
        # before the long benchmarks: its tests take seconds; a teardown that hangs is killed at the limit
        Stage("gpu-nccl", pytest_stage_argv(python, NCCL_TESTS), 60, summarize_tests),
        Stage("bench-decode", bench_argv(python, "decode", "eager,reduce-overhead,cg-local-eager,cg-full-iteration"),
              90, summarize_bench),
    ]
    hf = [m for m in bench_models() if m.startswith("hf")]
    if hf:
        result.append(Stage("bench-hf", bench_argv(python, ",".join(hf), "eager,reduce-overhead,cg-local-eager"),
                            120, summarize_bench))
    # last, with what is left: reduce-overhead's cold compile of the MoE step did not end within 120 s on an H200
    # (2026-11-26), while decode took 34 s and the HF row 75 s
    result.append(Stage("bench-moe", bench_argv(python, "moe", "eager,reduce-overhead,cg-local-eager"), 240,
                        summarize_bench))
    return result


# ---- running ------------------------------------------------------------------------------------------------

def run_stage(stage: Stage, limit_s: float, log_path: str) -> Outcome:
    """Run the stage in its own process group; past limit_s the whole group is killed (SIGKILL)."""
    started = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    argv = stage.command()
    with open(log_path, "w+") as log:
        log.write(f"$ {' '.join(argv)}  (limit {limit_s:.0f} s)\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
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
    return Outcome(stage, status, time.monotonic() - started, output, stage.summarize(output), argv)


def run_all(plan: List[Stage], budget_s: float, log_dir: str) -> List[Outcome]:
    """Every stage within its own limit and what is left of the budget; a stage after a failed required stage
    (the project install) or with under 10 s of budget left is not run."""
    deadline = time.monotonic() + budget_s
    outcomes: List[Outcome] = []
    for stage in plan:
        left = deadline - time.monotonic()
        failed = next((o.stage.name for o in outcomes if o.stage.required and o.status != "ok"), None)
        if failed:
            outcomes.append(Outcome(stage, f"not run: {failed} failed", 0.0, "", []))
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


def report_text(header: List[str], outcomes: List[Outcome], total_s: float, log_dir: str,
                budget_s: float = BUDGET_S) -> str:
    out = ["# cgcompile GPU check", "", *header, f"- total: {total_s:.0f} s (budget {budget_s:.0f} s)",
           f"- full logs: {log_dir}", "", "| stage | result | seconds |", "|---|---|---|"]
    out += [f"| {o.stage.name} | {o.status} | {o.seconds:.0f} |" for o in outcomes]
    for o in outcomes:
        out += ["", f"## {o.stage.name}: {o.status}", "", f"`{' '.join(o.argv or o.stage.command())}`", ""]
        out += [f"- {line}" for line in o.lines] or ["- (nothing to report)"]
        if o.status != "ok" and o.output:
            tail = o.output.splitlines()[-30:]
            out += ["", "last lines of output:", "", "```", *tail, "```"]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True, help="markdown report to write")
    parser.add_argument("--wheels", default=os.environ.get("WHEELS") or None,
                        help="install offline from this folder of wheels (pip --no-index --find-links); env WHEELS")
    parser.add_argument("--stages", default=None,
                        help="comma-separated stage names to run (default: all); a lease too short for both this "
                             "check and gpu-perf runs the test stages alone after gpu-perf's install")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all stages together")
    args = parser.parse_args(argv)
    if args.wheels:
        args.wheels = os.path.abspath(args.wheels)
    plan = stages(sys.executable, args.wheels)
    if args.stages:
        names = args.stages.split(",")
        unknown = sorted(set(names) - {s.name for s in plan})
        if unknown:
            parser.error(f"unknown stage(s) {unknown}; valid: {[s.name for s in plan]}")
        plan = [s for s in plan if s.name in names]
    try:
        import torch
        cuda = torch.cuda.is_available()
        why = f"torch {torch.__version__}: torch.cuda.is_available() is False"
    except ImportError as exc:
        cuda, why = False, f"torch cannot be imported ({exc})"
    if not cuda:
        print(f"gpu-check: no CUDA device ({why}); nothing was run and no report written. On a CUDA machine it "
              f"would run, in {args.budget:.0f} s at most:")
        for stage in plan:
            print(f"  {stage.name} (limit {stage.timeout_s:.0f} s): {' '.join(stage.command())}")
        return NO_CUDA_EXIT
    log_dir = os.path.splitext(os.path.abspath(args.report))[0] + ".logs"
    os.makedirs(log_dir, exist_ok=True)
    started = time.monotonic()
    outcomes = run_all(plan, args.budget, log_dir)
    text = report_text(machine_lines(), outcomes, time.monotonic() - started, log_dir, args.budget)
    with open(args.report, "w") as f:
        f.write(text)
    print(f"gpu-check: report written to {args.report}")
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Running and loading the benchmark scripts from tests (tests/test_benchmarks.py, tests/test_benchmarks_gpu.py,
tests/test_benchmark_kernels.py)."""

import importlib.util
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name, *args, timeout=240):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")  # CPU path; no OpenMP spinning
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def load_bench(name):
    if os.path.join(ROOT, "benchmarks") not in sys.path:  # the scripts import each other (gpu_harness, workloads_*)
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_bench_gpu():
    return load_bench("bench_gpu")


def table_of(out, workload):
    return out.split(f"\n{workload}: ")[1].split("\n\n")[0]


def rows_of(table):
    """{variant: {column: cell}} for the measured rows of a printed table (cells are split on 2+ spaces)."""
    lines = table.splitlines()
    header_at = next(i for i, line in enumerate(lines) if line.startswith("variant "))
    header = re.split(r"\s{2,}", lines[header_at].strip())
    rows = {}
    for line in lines[header_at + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == len(header) and not line.startswith(" "):
            rows[cells[0]] = dict(zip(header, cells))
    return rows

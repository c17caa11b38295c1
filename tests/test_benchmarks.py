"""The benchmark scripts run end to end: bench_gpu's no-CUDA skip and CPU plumbing run, bench_cpu's quick mode.

Numbers are not asserted (this is a shared CPU); the tables' shape, the goals and the failure paths are.
"""

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


def load_bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "benchmarks", "bench_gpu.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_gpu", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_gpu_skips_without_cuda():
    out = run_script("bench_gpu.py")
    assert out.startswith("skipped: no CUDA")
    assert len(out.strip().splitlines()) == 1


def test_bench_gpu_cpu_smoke_reports_every_variant_and_refusal():
    out = run_script("bench_gpu.py", "--cpu-smoke", "--quick", "--steps", "5", "--driver", "emulate",
                     "--variants", "eager,cg-local-eager,cg-full-iteration,cg-local-eager+sizes")
    moe_table = out.split("\nmoe: ")[1].split("\n\n")[0]
    decode_table = out.split("\ndecode: ")[1].split("\n\n")[0]
    varying_table = out.split("\ndecode-varying: ")[1].split("\n\n")[0]
    assert "KV-cache" in decode_table and "batch changing every step" in varying_table
    # capture_sizes rows run on both decode workloads and are refused for the MoE
    assert re.search(r"^cg-local-eager\+sizes\s+n/a: ValueError: capture_sizes rows are for the decode", moe_table,
                     re.M), moe_table
    for table in (decode_table, varying_table):
        m = re.search(r"cg-local-eager\+sizes stats: graphs_captured=(\d+), replays=(\d+), eager_fallbacks=0", table)
        assert m and int(m[1]) > 0 and int(m[2]) > 0, table
    for table in (moe_table, decode_table):
        assert re.search(r"^eager\s+\d+\.\d+\s+1\.00x", table, re.M), table
        assert re.search(r"^cg-local-eager\s+\d+\.\d+\s+\d+\.\d+x", table, re.M), table
    # The MoE's data-dependent dispatch makes whole-step capture impossible: reported, not crashed.
    assert re.search(r"^cg-full-iteration\s+n/a: ConfigError: .*full_iteration.*nonzero", moe_table, re.M), moe_table
    assert re.search(r"^cg-full-iteration\s+\d+\.\d+", decode_table, re.M), decode_table
    # The emulate driver really captured and replayed (the runtime counters are read per variant).
    for table in (moe_table, decode_table):
        m = re.search(r"cg-local-eager stats: graphs_captured=(\d+), replays=(\d+), eager_fallbacks=0", table)
        assert m and int(m[1]) > 0 and int(m[2]) > 0, table
    goals = out.split("\ngoals\n")[1]
    assert re.search(r"decode-varying step faster than reduce-overhead \(cg-local-eager\+sizes; speedup\)\s+-\s+n/a",
                     goals)
    assert re.search(r"moe step >= 1\.5x eager \(cg-local-eager\)\s+\d+\.\d+x\s+(PASS|MISS)", goals)
    assert re.search(r"compile\+capture <= 1/3 of reduce-overhead's \(cg-local-eager\)\s+-\s+n/a", goals)


def test_error_line_unwraps_backend_failures():
    bench = load_bench_gpu()

    class Wrapped(Exception):
        def __init__(self, inner):
            super().__init__("backend='cudagraph_modules' raised:\nValueError: boom")
            self.inner_exception = inner

    assert bench.error_line(Wrapped(ValueError("boom\nmore"))) == "ValueError: boom"
    assert bench.error_line(RuntimeError("cannot be captured:\n  nonzero at m.py:3\n")) == \
        "RuntimeError: cannot be captured: nonzero at m.py:3"


def test_error_line_keeps_the_reason_after_a_long_path():
    """The checkout path is the user's: a line is never cut, so the op after it survives any path length."""
    bench = load_bench_gpu()
    path = "/" + "/".join(["a-rather-long-directory-name"] * 20) + "/tests/models/moe.py"
    err = RuntimeError(f"cannot be captured:\n  dynamic_shape torch.nonzero at {path}:148 in layers.0.moe -- hint\n")
    line = bench.error_line(err)
    assert line == f"RuntimeError: cannot be captured: dynamic_shape torch.nonzero at {path}:148 in layers.0.moe -- hint"


def test_goal_rows_verdicts():
    bench = load_bench_gpu()
    R = bench.Result
    results = {
        "moe": {"eager": R("eager", step_ms=3.0, compile_s=0.1), "reduce-overhead": R("r", step_ms=1.5, compile_s=30.0),
                "cg-local-eager": R("c", step_ms=1.6, compile_s=5.0)},
        "decode": {"cg-local-eager": R("c", step_ms=1.05, busy_ms=1.0, compile_s=1.0),
                   "reduce-overhead": R("r", error="RuntimeError: x")},
    }
    verdicts = {text: (value, verdict) for text, value, verdict in bench.goal_rows(results)}
    assert verdicts["moe step >= 1.5x eager (cg-local-eager)"] == ("1.88x", "PASS")
    assert verdicts["moe step no slower than reduce-overhead (cg-local-eager; speedup)"] == ("0.94x", "MISS")
    assert verdicts["moe compile+capture <= 1/3 of reduce-overhead's (cg-local-eager)"] == ("0.17x", "PASS")
    assert verdicts["decode compile+capture <= 1/3 of reduce-overhead's (cg-local-eager)"] == ("-", "n/a")
    assert verdicts["decode step within 1.1x of its GPU-busy bound (cg-local-eager)"] == ("1.05x", "PASS")
    assert not any("cg-local-inductor" in text for text in verdicts)  # only variants that ran
    results["decode"]["cg-local-inductor"] = R("i", step_ms=1.2, busy_ms=1.0)
    results["decode"]["reduce-overhead"] = R("r", step_ms=1.0)
    results["decode"]["cg-full-iteration"] = R("f", step_ms=1.0, busy_ms=1.0)
    results["decode-varying"] = {"reduce-overhead": R("r", step_ms=3.0), "cg-local-eager+sizes": R("s", step_ms=1.0)}
    verdicts = {text: (value, verdict) for text, value, verdict in bench.goal_rows(results)}
    assert verdicts["decode step no slower than reduce-overhead (cg-local-inductor; speedup)"] == ("0.83x", "MISS")
    assert verdicts["decode step within 1.1x of its GPU-busy bound (cg-local-inductor)"] == ("1.20x", "MISS")
    assert verdicts["decode step within 1.1x of its GPU-busy bound (cg-full-iteration)"] == ("1.00x", "PASS")
    assert verdicts["decode-varying step faster than reduce-overhead (cg-local-eager+sizes; speedup)"] == \
        ("3.00x", "PASS")


def test_bench_cpu_quick_table():
    out = run_script("bench_cpu.py", "--quick", "--emulate")
    rows = [line for line in out.splitlines() if line.startswith("(")]
    assert [r[:3] for r in rows] == ["(a)", "(a)", "(b)", "(b)", "(c)"]
    for row in rows:
        m = re.search(r"(\d+\.\d+)x\s+<= (\d+\.\d+)x\s+(PASS|MISS)$", row)
        assert m, row
        ratio, goal, verdict = float(m[1]), float(m[2]), m[3]
        assert verdict == ("PASS" if ratio <= goal else "MISS")
    assert "driver=auto" in rows[0] and "driver=emulate" in rows[1]
    assert "aot_eager" in rows[0] and "eager backend" in rows[2]
    padding = {line.split()[0]: line.split() for line in out.split("dynamic_padding (d)")[1].splitlines()[2:6]}
    assert list(padding) == ["eager", "off", "max", "buckets"]
    assert float(padding["max"][5]) == 0.0  # host syncs per step with dynamic_padding="max"
    assert float(padding["max"][1]) < float(padding["eager"][1]) / 4  # kernel ops outside graphs

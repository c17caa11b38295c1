"""The GPU benchmark scripts run end to end without CUDA: bench_gpu's skip and its CPU smoke runs (every variant,
every realistic workload, on the emulate driver), gpu_perf's plan and CPU plumbing, the goal rows and error lines.

Numbers are not asserted (this is a shared CPU); the tables' shape, the goals and the failure paths are.
"""

import os
import re
import sys

from tests.bench_scripts import ROOT, load_bench, load_bench_gpu, rows_of, run_script, table_of


def test_bench_gpu_skips_without_cuda():
    out = run_script("bench_gpu.py")
    assert out.startswith("skipped: no CUDA")
    assert len(out.strip().splitlines()) == 1


SMOKE_VARIANTS = ("eager,cg-local-eager,cg-full-iteration,cg-local-eager+sizes,cg-local-eager+max,"
                  "cg-full-iteration+max")


def test_bench_gpu_cpu_smoke_reports_every_variant_and_refusal():
    out = run_script("bench_gpu.py", "--cpu-smoke", "--quick", "--steps", "5", "--driver", "emulate",
                     "--models", "moe,moe-fixed,mixtral,decode,decode-varying", "--variants", SMOKE_VARIANTS)
    moe_table, fixed_table, mixtral_table = (table_of(out, w) for w in ("moe", "moe-fixed", "mixtral"))
    decode_table, varying_table = table_of(out, "decode"), table_of(out, "decode-varying")
    assert "new tokens every step (pool of 32 batches)" in moe_table.splitlines()[0]
    assert "the same tokens every step" in fixed_table.splitlines()[0]
    assert "new tokens every step" in mixtral_table.splitlines()[0] and "expert_mask[e]" in mixtral_table
    assert "KV-cache" in decode_table and "batch changing every step" in varying_table
    # capture_sizes rows run on both decode workloads and are refused for the MoE workloads; padding the reverse
    for table in (moe_table, fixed_table, mixtral_table):
        assert re.search(r"^cg-local-eager\+sizes\s+n/a: ValueError: capture_sizes rows are for the decode", table,
                         re.M), table
    for table in (decode_table, varying_table):
        m = re.search(r"cg-local-eager\+sizes stats: graphs_captured=(\d+), replays=(\d+), eager_fallbacks=0", table)
        assert m and int(m[1]) > 0 and int(m[2]) > 0, table
        for v in ("cg-local-eager+max", "cg-full-iteration+max"):
            assert re.search(rf"^{re.escape(v)}\s+n/a: ValueError: dynamic_padding rows are for the MoE workloads",
                             table, re.M), table
    for table in (moe_table, decode_table):
        assert re.search(r"^eager\s+\d+\.\d+\s+1\.00x", table, re.M), table
        assert re.search(r"^cg-local-eager\s+\d+\.\d+\s+\d+\.\d+x", table, re.M), table
    # Data-dependent dispatch makes whole-step capture impossible without padding: reported, not crashed.
    for table, op in ((moe_table, "nonzero"), (fixed_table, "nonzero"), (mixtral_table, "torch.where")):
        assert re.search(rf"^cg-full-iteration\s+n/a: ConfigError: .*full_iteration.*{re.escape(op)}", table,
                         re.M), table
    assert re.search(r"^cg-full-iteration\s+\d+\.\d+", decode_table, re.M), decode_table
    # The emulate driver really captured and replayed (the runtime counters are read per variant).
    for table in (moe_table, decode_table):
        m = re.search(r"cg-local-eager stats: graphs_captured=(\d+), replays=(\d+), eager_fallbacks=0", table)
        assert m and int(m[1]) > 0 and int(m[2]) > 0, table
    # dynamic_padding="max": the MoE step captured without a host read, locally and as a whole step.
    for table in (moe_table, fixed_table, mixtral_table):
        assert "CPU proxy, cgcompile.profiling" in table
        rows = rows_of(table)
        eager = rows["eager"]
        assert float(eager["syncs"]) > 0 and float(eager["graph launches"]) == 0, table
        assert float(rows["cg-local-eager"]["syncs"]) > 0, table  # experts (and their nonzero) stay eager
        for v in ("cg-local-eager+max", "cg-full-iteration+max"):
            assert float(rows[v]["syncs"]) == 0, table
            assert float(rows[v]["graph launches"]) > 0, table
            assert float(rows[v]["launches"]) < float(rows["cg-local-eager"]["launches"]) / 2, table
            m = re.search(rf"{re.escape(v)} stats: graphs_captured=(\d+), replays=\d+, eager_fallbacks=0", table)
            assert m and int(m[1]) > 0, table
        # whole step: one forward and one backward graph per step
        assert float(rows["cg-full-iteration+max"]["graph launches"]) == 2, table
    goals = out.split("\ngoals (CPU smoke: ratios shown, not judged)\n")[1]
    assert "PASS" not in goals and "MISS" not in goals
    assert re.search(r"decode-varying step faster than reduce-overhead \(cg-local-eager\+sizes; speedup\)\s+-\s+n/a",
                     goals)
    assert re.search(r"moe step >= 1\.5x eager \(cg-local-eager\)\s+\d+\.\d+x\s+n/a", goals)
    assert re.search(r"compile\+capture <= 1/3 of reduce-overhead's \(cg-local-eager\)\s+-\s+n/a", goals)
    for w in ("moe", "mixtral"):
        for v in ("cg-local-eager+max", "cg-full-iteration+max"):
            v = re.escape(v)
            assert re.search(rf"{w} step >= 3x eager \({v}\)\s+\d+\.\d+x\s+n/a", goals), goals
            assert re.search(rf"{w} step >= 2x reduce-overhead \({v}; speedup\)\s+-\s+n/a", goals), goals
            assert re.search(rf"{w} step within 1\.5x of its GPU-busy bound \({v}\)\s+-\s+n/a", goals), goals
            assert re.search(rf"{w} peak memory <= 1\.5x eager's \({v}\)\s+-\s+n/a", goals), goals
    assert "moe-fixed" not in goals and "+buckets" not in goals  # rows only for the workloads and variants that ran


def test_bench_gpu_cpu_smoke_runs_every_realistic_workload_through_every_variant():
    """--cpu-smoke alone: every realistic workload (workloads_hf.py) at a tiny size, every variant it lists, on the
    emulate driver: a measured row whose outputs agree with eager's, or a row that says why it did not run here."""
    out = run_script("bench_gpu.py", "--cpu-smoke", timeout=300)
    hf = load_bench("workloads_hf")
    status = {(m[1], m[2]): m[3] for m in re.finditer(r"^  \[(\S+)\] (\S+): (.*)$", out, re.M)}
    for name in hf.MODELS:
        variants = (hf.SYNC_VARIANTS if name == "qwen3moe-sync" else hf.TRAIN_VARIANTS if "train" in name
                    else hf.VARYING_VARIANTS if name.endswith("varying") else hf.DECODE_VARIANTS)
        assert [v for (w, v) in status if w == name] == list(variants), (name, out)
        table = table_of(out, name)
        for variant in variants:
            text = status[(name, variant)]
            if variant == "reduce-overhead":
                assert text.startswith("skipped: needs CUDA"), text
            elif "inductor" in variant:
                assert text.startswith("skipped: CPU smoke: Inductor"), text
            elif variant == "eager":
                assert re.match(r"\d+\.\d+ ms/step", text), text
            else:  # cgcompile captured and replayed, and its outputs equal eager's over the same steps
                assert re.search(r"out diff vs eager \S+ \(agrees\)$", text), (name, variant, text)
                m = re.search(rf"{re.escape(variant)} stats: graphs_captured=(\d+), replays=(\d+), eager_fallbacks=0",
                              table)
                assert m and int(m[1]) > 0 and int(m[2]) > 0, table
    assert "new tokens every step" in table_of(out, "llama-train").splitlines()[0]
    assert "batch changing every step" in table_of(out, "llama8b-decode-varying").splitlines()[0]
    goals = out.split("\ngoals (CPU smoke: ratios shown, not judged)\n")[1]
    assert re.search(r"qwen3moe-sync step >= 3x eager \(cg-local-eager\+max\)\s+\d+\.\d+x\s+n/a", goals), goals
    assert re.search(r"llama-train peak memory <= 1\.3x eager's \(cg-local-eager\)\s+-\s+n/a", goals), goals
    assert re.search(r"llama8b-decode-b1 step within 1\.1x of its GPU-busy time \(cg-local-eager\+block\)", goals)


def test_gpu_perf_without_cuda_prints_its_plan():
    out = run_script("gpu_perf.py", timeout=120)
    assert out.startswith("gpu-perf: no CUDA device")
    perf = load_bench("gpu_perf")
    budgets = re.findall(r"^  (\S+)\s+(\d+) s  ", out, re.M)
    assert [name for name, _ in budgets] == [s.name for s in perf.stages()]
    assert sum(int(b) for _, b in budgets) <= perf.BUDGET_S <= 540  # one 9-minute call
    assert "pip install -q --no-deps --no-build-isolation -e ." in out
    hf = load_bench("workloads_hf")
    named = ",".join(re.findall(r"--models (\S+)", out)).split(",")
    assert set(hf.MODELS) <= set(named) and {"moe", "decode"} <= set(named)
    assert out.count("--markdown ") == len(budgets) - 1 and "--inductor-cache" in out
    diffs = re.findall(r"--variants (\S+) .*--kernel-diff (\S+),(\S+)", out)  # issue 36's kernel tables
    assert {"decode-b1", "llama-train", "moe-train"} <= {s.name for s in perf.stages() if s.kernel_diff}
    assert diffs and all(a == "reduce-overhead" and {a, b} <= set(variants.split(",")) for variants, a, b in diffs)


def test_gpu_lease_fits_one_call_and_names_real_stages():
    """`make gpu-lease`: gpu-perf's and gpu-check's stages for a 15-minute lease (a machine's start and one call of
    at most 600 s): the budgets within 570 s, every stage it names one the scripts have (they refuse others)."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        recipe = f.read().split("\ngpu-lease:\n")[1].split("\n\n")[0].replace("\\\n", " ")
    perf, check = load_bench("gpu_perf"), load_bench("gpu_check")
    known = {"gpu_perf.py": {s.name for s in perf.stages()}, "gpu_check.py": {s.name for s in check.stages("python")}}
    calls = re.findall(r"benchmarks/(gpu_\w+\.py)([^\n]*)", recipe)
    assert [script for script, _ in calls] == ["gpu_perf.py", "gpu_check.py", "gpu_perf.py"]
    assert sum(float(re.search(r"--budget (\d+)", args).group(1)) for _, args in calls) <= 570
    for script, args in calls:
        assert set(re.search(r"--stages (\S+)", args).group(1).split(",")) <= known[script], (script, args)
    picked = run_script("gpu_perf.py", "--stages", "decode-b1,moe-train", timeout=120)
    assert re.findall(r"^  (\S+)\s+\d+ s  ", picked, re.M) == ["decode-b1", "moe-train"]


def test_gpu_perf_stage_killed_at_its_limit_keeps_its_rows(tmp_path):
    perf = load_bench("gpu_perf")
    report = tmp_path / "r.md"
    code = (f"import time; open({str(report)!r}, 'a').write('- row 1\\n'); print('row 1', flush=True); "
            "time.sleep(30)")
    status = perf.run_stage([sys.executable, "-c", code], 3, str(tmp_path / "s.log"), dict(os.environ))
    assert status.startswith("killed at its limit of 3 s")
    assert report.read_text() == "- row 1\n" and "row 1" in (tmp_path / "s.log").read_text()
    assert perf.run_stage([sys.executable, "-c", "pass"], 30, str(tmp_path / "t.log"), dict(os.environ)) == "ok"


def test_goal_rows_issue_37_goals():
    bench = load_bench_gpu()
    R = bench.Result
    results = {
        "qwen3moe-sync": {"eager": R("e", step_ms=30.0, peak_mib=100.0), "reduce-overhead": R("r", step_ms=20.0),
                          "cg-local-eager+max": R("m", step_ms=9.0, peak_mib=120.0),
                          "cg-local-eager+off": R("o", step_ms=25.0, peak_mib=140.0),
                          "cg-local-inductor+max": R("i", skipped="CPU smoke")},
        "llama-train": {"eager": R("e", step_ms=100.0, peak_mib=1000.0),
                        "cg-local-eager": R("c", step_ms=99.0, peak_mib=1400.0)},
        "llama8b-decode-b1": {"cg-local-eager+block": R("b", step_ms=1.05, busy_ms=1.0),
                              "cg-local-eager+layer": R("l", step_ms=1.5, busy_ms=1.0)},
    }
    verdicts = {text: (value, verdict) for text, value, verdict in bench.goal_rows(results)}
    assert verdicts["qwen3moe-sync step >= 3x eager (cg-local-eager+max)"] == ("3.33x", "PASS")
    assert verdicts["qwen3moe-sync step >= 2x reduce-overhead (cg-local-eager+max; speedup)"] == ("2.22x", "PASS")
    assert not any("(cg-local-eager+off)" in t and "step >= 3x eager" in t for t in verdicts)  # no padding: no such goal
    assert not any("cg-local-inductor+max" in t for t in verdicts)  # skipped rows are not judged
    assert verdicts["qwen3moe-sync peak memory <= 1.3x eager's (cg-local-eager+max)"] == ("1.20x", "PASS")
    assert verdicts["qwen3moe-sync peak memory <= 1.3x eager's (cg-local-eager+off)"] == ("1.40x", "MISS")
    assert verdicts["llama-train peak memory <= 1.3x eager's (cg-local-eager)"] == ("1.40x", "MISS")
    assert verdicts["llama8b-decode-b1 step within 1.1x of its GPU-busy time (cg-local-eager+block)"] == \
        ("1.05x", "PASS")
    assert verdicts["llama8b-decode-b1 step within 1.1x of its GPU-busy time (cg-local-eager+layer)"] == \
        ("1.50x", "MISS")


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
    assert not any("3x eager" in text for text in verdicts)  # no padded variant ran yet
    results["mixtral"] = {"eager": R("e", step_ms=6.0, peak_mib=100.0), "reduce-overhead": R("r", step_ms=2.5),
                          "cg-local-eager+max": R("m", step_ms=2.0, busy_ms=1.6, peak_mib=160.0),
                          "cg-local-eager+buckets": R("b", step_ms=3.0, busy_ms=1.0, peak_mib=120.0)}
    verdicts = {text: (value, verdict) for text, value, verdict in bench.goal_rows(results)}
    assert verdicts["mixtral step >= 3x eager (cg-local-eager+max)"] == ("3.00x", "PASS")
    assert verdicts["mixtral step >= 2x reduce-overhead (cg-local-eager+max; speedup)"] == ("1.25x", "MISS")
    assert verdicts["mixtral step within 1.5x of its GPU-busy bound (cg-local-eager+max)"] == ("1.25x", "PASS")
    assert verdicts["mixtral peak memory <= 1.5x eager's (cg-local-eager+max)"] == ("1.60x", "MISS")
    assert verdicts["mixtral step >= 3x eager (cg-local-eager+buckets)"] == ("2.00x", "MISS")
    assert verdicts["mixtral step within 1.5x of its GPU-busy bound (cg-local-eager+buckets)"] == ("3.00x", "MISS")
    assert verdicts["mixtral peak memory <= 1.5x eager's (cg-local-eager+buckets)"] == ("1.20x", "PASS")
    assert not any(text.startswith("moe step >= 3x") for text in verdicts)  # moe ran no padded variant
    unjudged = {text: (value, verdict) for text, value, verdict in bench.goal_rows(results, judged=False)}
    assert unjudged["mixtral step >= 3x eager (cg-local-eager+max)"] == ("3.00x", "n/a")
    assert {verdict for _, verdict in unjudged.values()} == {"n/a"}


def test_gpu_perf_cpu_plumbing_writes_the_report_row_by_row(tmp_path):
    """--cpu-plumbing runs gpu_perf's own loop on the CPU (stages with bench_gpu.py --cpu-smoke): the header, the
    stage, each row, the table and the stage summary reach the report; two files in the output folder."""
    out = run_script("gpu_perf.py", "--cpu-plumbing", "--stages", "decode-b1", "--out", str(tmp_path), timeout=120)
    assert "gpu-perf: decode-b1: ok" in out
    assert sorted(os.listdir(tmp_path)) == ["gpu-perf.log", "gpu-perf.md", "inductor-cache"] or \
        sorted(os.listdir(tmp_path)) == ["gpu-perf.log", "gpu-perf.md"]
    report = (tmp_path / "gpu-perf.md").read_text()
    assert "- device: CPU (--cpu-plumbing" in report and "- commit: " in report and "- date: " in report
    assert "## decode-b1 (limit 70 s)" in report
    assert re.search(r"^- `cg-local-eager\+block`: \d+\.\d+ ms/step, .*\(agrees\)$", report, re.M), report
    assert re.search(r"^- `reduce-overhead`: skipped: needs CUDA", report, re.M), report
    assert "| decode-b1 | ok |" in report and "goals (CPU smoke" in report
    assert "kernel diff reduce-overhead vs cg-local-inductor+block (llama8b-decode-b1): no table: reduce-overhead " \
        "(skipped: needs CUDA" in report, report

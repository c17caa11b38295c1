"""benchmarks/gpu_check.py on a machine without CUDA: it names what it would run and exits non-zero; and the
parts that keep it from hanging (a stage past its limit is killed with its children, the overall budget) and
read its stages' output, run for real on small commands."""

import os
import subprocess
import sys
import time

from benchmarks import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_cuda_prints_the_plan_and_exits_non_zero(tmp_path):
    report = tmp_path / "report.md"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--report", str(report)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == gpu_check.NO_CUDA_EXIT, proc.stdout + proc.stderr
    assert proc.stdout.startswith("gpu-check: no CUDA device"), proc.stdout
    for stage in ("install", "gpu-tests", "bench-moe", "bench-decode", "gpu-nccl"):
        assert f"  {stage} (limit " in proc.stdout, proc.stdout
    assert "--no-index" not in proc.stdout
    assert "--no-build-isolation -e ." in proc.stdout and "--timeout=" in proc.stdout
    assert "bench_gpu.py --quick --models moe" in proc.stdout and "--models decode" in proc.stdout
    assert not report.exists()


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_a_stage_past_its_limit_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(120)")
    stage = gpu_check.Stage("sleeper", [sys.executable, "-c", script], 120, gpu_check.summarize_tail)
    started = time.monotonic()
    outcome = gpu_check.run_stage(stage, 3, str(tmp_path / "sleeper.log"))
    assert time.monotonic() - started < 30
    assert outcome.status == "timed out after 3 s (killed)" and outcome.lines == ["started"], outcome
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is asynchronous
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


def test_stages_past_the_overall_budget_are_not_run(tmp_path):
    quick = gpu_check.Stage("quick", [sys.executable, "-c", "print('hi')"], 60, gpu_check.summarize_tail)
    failing = gpu_check.Stage("failing", [sys.executable, "-c", "raise SystemExit(3)"], 60, gpu_check.summarize_tail)
    outcomes = gpu_check.run_all([quick, failing], 60, str(tmp_path))
    assert [o.status for o in outcomes] == ["ok", "failed (exit 3)"]
    assert outcomes[0].lines == ["hi"]
    one_second = gpu_check.Stage("one-second", [sys.executable, "-c", "import time; time.sleep(1)"], 60,
                                 gpu_check.summarize_tail)
    outcomes = gpu_check.run_all([one_second, quick], 10.5, str(tmp_path))
    assert outcomes[0].status == "ok" and outcomes[1].status == "not run: overall budget of 10 s used", outcomes


def test_test_results_are_read_from_pytest_output(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_sample.py").write_text("import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n"
                                          "    assert False\n\n@pytest.mark.skip\ndef test_skipped():\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = gpu_check.summarize_tests(proc.stdout)
    assert lines[:3] == ["tests/test_sample.py::test_ok: PASSED", "tests/test_sample.py::test_bad: FAILED",
                         "tests/test_sample.py::test_skipped: SKIPPED"], proc.stdout
    assert lines[3].startswith("total: 1 failed, 1 passed, 1 skipped"), lines


def test_the_report_names_every_stage_and_its_failure(tmp_path):
    ok = gpu_check.Outcome(gpu_check.Stage("a", ["true"], 1, gpu_check.summarize_tail), "ok", 1.0, "x", ["x"])
    bad = gpu_check.Outcome(gpu_check.Stage("b", ["false"], 1, gpu_check.summarize_tail), "failed (exit 1)", 2.0,
                            "boom", [])
    text = gpu_check.report_text(["- device: d"], [ok, bad], 3.0, "logs")
    assert "| a | ok | 1 |" in text and "| b | failed (exit 1) | 2 |" in text
    assert "## b: failed (exit 1)" in text and "```\nboom\n```" in text


def test_stage_order_puts_nccl_before_the_benchmarks_and_cgcompile_first_in_each():
    """The MoE benchmark once spent its 120 s on reduce-overhead's cold compile before cgcompile's own row, and
    NCCL, last, was usually out of budget; on an H200 its reduce-overhead row still ran out of 120 s: it runs last,
    with what is left."""
    plan = gpu_check.stages("python")
    names = [s.name for s in plan]
    assert names[:4] == ["install", "gpu-tests", "gpu-nccl", "bench-decode"] and names[-1] == "bench-moe", names
    for stage in plan:
        if stage.name.startswith("bench-"):
            variants = stage.command()[stage.command().index("--variants") + 1].split(",")
            assert variants[0] == gpu_check.CG_FIRST and "reduce-overhead" in variants, variants
    assert [s.name for s in plan if s.required] == ["install"]


def test_wheels_make_every_pip_call_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "TEST_PACKAGES", {"cgcompile_no_such_module": "cgcompile-no-such-package"})
    command = gpu_check.install_argv("python", str(tmp_path))[-1]
    assert command.count("-m pip install") == 2, command  # the project, then the missing test package
    assert command.count(f"--no-index --find-links {tmp_path}") == 2, command
    # the flag (make passes WHEELS=dir as --wheels) reaches the plan; here, without CUDA, the printed plan
    assert gpu_check.main(["--report", str(tmp_path / "r.md"), "--wheels", str(tmp_path)]) == gpu_check.NO_CUDA_EXIT
    assert f"--no-index --find-links {tmp_path}" in capsys.readouterr().out
    assert '--wheels "$(WHEELS)"' in open(os.path.join(ROOT, "Makefile")).read()


def test_a_test_package_without_a_wheel_is_reported_and_fails_nothing(tmp_path):
    """Offline, with a wheel folder that lacks the package: pip fails, the install line says so, and the stage
    still ends well (only a failed project install stops the later stages)."""
    lines = gpu_check.optional_installs(sys.executable, ["cgcompile-no-such-package"], str(tmp_path))
    stage = gpu_check.Stage("install", ["bash", "-c", " && ".join(["true", *lines, "echo after"])], 60,
                            gpu_check.summarize_install, required=True)
    outcome = gpu_check.run_stage(stage, 60, str(tmp_path / "install.log"))
    assert outcome.status == "ok", outcome.output
    assert outcome.lines[0].startswith("gpu-check: test package cgcompile-no-such-package not installed (no wheel")
    assert outcome.lines[-1] == "after"


def test_a_failed_required_stage_stops_the_rest(tmp_path):
    install = gpu_check.Stage("install", [sys.executable, "-c", "raise SystemExit(1)"], 60, gpu_check.summarize_tail,
                              required=True)
    tests = gpu_check.Stage("gpu-tests", [sys.executable, "-c", "print('ran')"], 60, gpu_check.summarize_tail)
    outcomes = gpu_check.run_all([install, tests], 60, str(tmp_path))
    assert [o.status for o in outcomes] == ["failed (exit 1)", "not run: install failed"]


def test_a_module_that_does_not_import_leaves_the_other_tests_running(tmp_path):
    """A collection error (a module importing a package the box lacks) used to stop pytest before any test ran."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_broken.py").write_text("import cgcompile_no_such_module\n\ndef test_never():\n    pass\n")
    (tests / "test_fine.py").write_text("def test_ok():\n    pass\n")
    argv = gpu_check.pytest_argv(sys.executable, "tests", timeout=False)
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = gpu_check.summarize_tests(proc.stdout)
    assert "tests/test_fine.py::test_ok: PASSED" in lines, proc.stdout
    assert any(line.startswith("tests/test_broken.py: not collected (") and "cgcompile_no_such_module" in line
               for line in lines), lines
    assert lines[-1].startswith("total: 1 passed, 1 error"), lines
    assert "--timeout=" not in " ".join(argv)  # without pytest-timeout the flag would be a usage error


def test_stages_pick_what_runs_and_an_unknown_name_is_refused(tmp_path):
    """--stages and --budget (`make gpu-lease` runs the test stages beside gpu-perf's in one short lease)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    argv = [sys.executable, "benchmarks/gpu_check.py", "--report", str(tmp_path / "r.md"), "--budget", "200"]
    picked = subprocess.run(argv + ["--stages", "gpu-tests,gpu-nccl"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert "in 200 s at most" in picked.stdout, picked.stdout
    assert [line.split()[0] for line in picked.stdout.splitlines()[1:]] == ["gpu-tests", "gpu-nccl"]
    wrong = subprocess.run(argv + ["--stages", "gpu-test"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    assert wrong.returncode == 2 and "unknown stage(s) ['gpu-test']; valid: ['install', 'gpu-tests'" in wrong.stderr

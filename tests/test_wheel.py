"""The package stands on its own: a wheel built from the sources, installed into an empty directory, runs
`python -m cgcompile.demo` from outside the repository (nothing from tests/ or the checkout on the path)."""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

from cgcompile import _compat

REPO = pathlib.Path(__file__).resolve().parent.parent


def run(args, cwd, env=None, timeout=300):
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_demo_runs_from_an_installed_wheel(tmp_path):
    source = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    # the helper `pip install -e .` compiled in place in the checkout is left out: the wheel build compiles its own
    shutil.copytree(REPO / "cgcompile", source / "cgcompile", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ".", "-w",
         str(tmp_path / "dist")], cwd=source)
    (wheel,) = (tmp_path / "dist").glob("cgcompile-*.whl")
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler:  # the optional compiled helpers are in the wheel wherever they can be built
        with zipfile.ZipFile(wheel) as contents:
            for helper in ("_address_check", "_scope_gate", "_steady_replay"):
                assert any(n.startswith(f"cgcompile/{helper}") for n in contents.namelist()), contents.namelist()
    target = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], cwd=tmp_path)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}  # torch comes from this interpreter's environment
    where = run([sys.executable, "-c", "import cgcompile; print(cgcompile.__file__)"], cwd=outside, env=env)
    assert pathlib.Path(where.strip()).is_relative_to(target)
    impl = run([sys.executable, "-c", "from cgcompile import _compat; print(_compat.ADDRESS_CHECK_IMPL)"], cwd=outside,
               env=env)
    assert impl.strip() == _compat.ADDRESS_CHECK_IMPL  # the installed helper loads and is used, as the checkout's
    out = run([sys.executable, "-m", "cgcompile.demo", "--steps", "1", "--layers", "1", "--html", ""],
              cwd=outside, env=env)
    assert "cgcompile plan: cuda_graph_impl=local" in out
    assert "capture  attn+moe_router+moe_preprocess  layers.0" in out
    assert "step 0: loss" in out

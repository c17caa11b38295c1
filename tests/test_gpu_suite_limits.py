"""Every GPU test module carries a per-test time limit (pytest-timeout), so a stuck capture or NCCL call
fails the run instead of hanging it. Checked on CPU, where those tests are skipped."""

import importlib
import pathlib

import pytest

GPU_MODULES = sorted(p.stem for p in (pathlib.Path(__file__).parent / "gpu").glob("test_*.py"))


def test_pytest_timeout_is_installed():
    importlib.import_module("pytest_timeout")


@pytest.mark.parametrize("name", GPU_MODULES)
def test_gpu_module_has_a_timeout(name):
    module = importlib.import_module(f"tests.gpu.{name}")
    limits = [m.args[0] for m in module.pytestmark if m.name == "timeout"]
    assert limits and 0 < limits[0] <= 600, name

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


OPTIONAL_TEST_PACKAGES = ("expecttest", "hypothesis", "numpy")  # pyproject's test extra beyond pytest itself
_WITHOUT_OPTIONAL = f"""
import importlib, importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {OPTIONAL_TEST_PACKAGES!r}:
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Missing())
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module("tests.gpu." + name)
    except ImportError as exc:
        failed.append(f"{{name}}: {{exc!r}}")
print("\\n".join(failed))
"""


def test_gpu_modules_import_without_the_optional_test_packages():
    """A fresh GPU box may lack expecttest, hypothesis or numpy (make gpu-check installs them only when it can):
    the GPU tests need none of them, so none may reach them through a CPU test module it borrows helpers from
    (a collection error would skip the whole module)."""
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_OPTIONAL, *GPU_MODULES], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr[-2000:]

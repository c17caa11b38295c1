"""Whether Inductor can build its C++ kernels here (the tests that compile partitions with inner_compiler="inductor"
on the CPU need it), and if not, why: a skip reason that names the cause."""

from __future__ import annotations

import os
import shutil
from typing import Optional

import pytest
import torch

__all__ = ["needs_inductor_cpp", "why_no_inductor_cpp"]


def why_no_inductor_cpp() -> Optional[str]:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "needs a C++ compiler"
    torch_dir = os.path.dirname(torch.__file__)
    if any(c.isspace() for c in torch_dir):  # seen with torch 2.13: 'ld: cannot find run/a: No such file'
        return (f"torch is installed under a path with whitespace ({torch_dir!r}): Inductor's C++ builder passes its "
                f"-I/-L paths unquoted, so its kernels do not link")
    return None


_WHY = why_no_inductor_cpp()

# a mark for a test (or a parameter) that compiles Inductor C++ kernels on the CPU
needs_inductor_cpp = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

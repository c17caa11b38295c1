"""cgcompile's optional compiled helpers for the host path (cgcompile/csrc, built at install where a C++ compiler
exists; setup.py), and the switch that leaves them out.

`CGCOMPILE_PYTHON_HOST_PATH=1` runs the steps they take over in Python instead, as where they were not built (to
profile those steps with a Python profiler, or to compare): read when a compiled frame is built, so it applies to
frames compiled from then on.
"""

from __future__ import annotations

import os

try:  # runtime/local/steady.py: a frame's steady copy-out replay in one C call
    from . import _steady_replay as STEADY_REPLAY
except ImportError:
    STEADY_REPLAY = None
try:  # scope.py: a ScopedFrame's scope look-up in one C call
    from . import _scope_gate as SCOPE_GATE
except ImportError:
    SCOPE_GATE = None
try:  # runtime/local/serialized.py: a compiled frame's calls one at a time, in one C call
    from . import _serialized_call as SERIALIZED_CALL
except ImportError:
    SERIALIZED_CALL = None

__all__ = ["PYTHON_HOST_PATH", "SCOPE_GATE", "SERIALIZED_CALL", "STEADY_REPLAY", "compiled_host_path"]

PYTHON_HOST_PATH = "CGCOMPILE_PYTHON_HOST_PATH"


def compiled_host_path() -> bool:
    """Do frames built now use the compiled helpers that were built (the switch is not set)?"""
    return os.environ.get(PYTHON_HOST_PATH, "") in ("", "0")

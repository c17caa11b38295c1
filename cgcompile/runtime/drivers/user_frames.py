"""Where in the user's code the running Python is: for errors raised deep inside torch or cgcompile."""

from __future__ import annotations

import os
import traceback

import torch

__all__ = ["user_location"]

_LIBRARIES = tuple(os.path.dirname(os.path.abspath(p)) + os.sep for p in (
    torch.__file__, os.path.dirname(os.path.abspath(__file__))))


def user_location() -> str:
    """The innermost stack frame outside torch, cgcompile and generated code (FX's `<eval_with_key>`): the
    user's file:line that led here, or "?"."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename) if not frame.filename.startswith("<") else ""
        if path and not path.startswith(_LIBRARIES):
            return f"{frame.filename}:{frame.lineno}"
    return "?"

"""cgcompile's own code is never traced by Dynamo.

A training step compiled whole (`torch.compile(train_step)`: forward, `loss.backward()`, `optimizer.step()`) graph-
breaks at `loss.backward()` and runs the backward pass with Dynamo's frame hook still set, so every Python frame the
backward reaches is one Dynamo would compile: the runtime's backward replays, the backward graphs' lazy compile (the
planner and its passes), the after-backward callbacks. Compiled, they were partitioned by the backend itself: 370
frames for a 2-layer model's four steps, graphs captured around the runtime's own helpers. Two guards, as torch
keeps its own package out: the modules below are on Dynamo's skip list, so their frames run as written
(`skip_own_frames`, at the backend's first call: importing cgcompile does not import Dynamo); and the backward
compiler and runner turn the hook off while they run (`_compat.untraced_in_backward`), so the graph code they call
is not traced either.

Left traceable: the example models (`cgcompile.examples`) and the demo, which are user code.
"""

from __future__ import annotations

import functools
import pkgutil

from . import _compat

__all__ = ["USER_CODE", "own_modules", "skip_own_frames"]

USER_CODE = frozenset({"examples", "demo"})  # modules of this package that hold models, traced as the user's are


def own_modules() -> list:
    """The import names of every module and subpackage of cgcompile but USER_CODE."""
    import cgcompile

    return sorted(f"cgcompile.{info.name}" for info in pkgutil.iter_modules(cgcompile.__path__)
                  if info.name not in USER_CODE)


@functools.cache
def skip_own_frames() -> None:
    """Once per process."""
    _compat.skip_frames_of(own_modules())

"""The module a Dynamo graph's frame belongs to, so tags survive Dynamo graph breaks.

After a graph break inside a module's forward (transformers 5's eager experts loop over `nonzero()`), Dynamo
compiles the rest of that method, and every module method it calls afterwards, as new frames whose root is the
module itself: their nodes' `nn_module_stack` starts *below* that module, with paths relative to it. Without the
frame's root the module's own tag and its place in the model are lost ("no module in the graph carries that
tag"). The root is the frame's `self`; its path is its name among the modules of the outermost module still
running on the Python stack (the model the user called).
"""

from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch.fx as fx
import torch.nn as nn

from . import _compat

FRAME_ROOT_KEY = "cgcompile_frame_root"  # key prefix of the entries prepended to each node's nn_module_stack


def _receiver(code, f_locals) -> object:
    """A method's `self`, whatever the code names it: `self` when it has one, else its first positional argument
    (`def forward(s, x)`), else None."""
    if code is None:
        return None
    if "self" in code.co_varnames:
        return f_locals.get("self")
    return f_locals.get(code.co_varnames[0]) if code.co_argcount else None


def running_model() -> Optional[nn.Module]:
    """The outermost `self` that is an nn.Module among the Python frames now running (the user's model)."""
    outermost = None
    frame = sys._getframe(1)
    while frame is not None:
        # `self` only: torch's own call frames (Module._call_impl, a compiled wrapper's) always name it so, and a
        # first argument would find a backend's GraphModule
        candidate = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(candidate, nn.Module):
            inner = getattr(candidate, "_orig_mod", None)  # torch.compile's wrapper: its model is the root
            outermost = inner if isinstance(inner, nn.Module) else candidate
        frame = frame.f_back
    return outermost


def _caller_self(code) -> Optional[nn.Module]:
    """The `self` of the innermost running frame of the method a resume function continues (same file): it is
    the frame that calls the resume function."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == code.co_filename:
            candidate = _receiver(frame.f_code, frame.f_locals)
            if isinstance(candidate, nn.Module):
                return candidate
        frame = frame.f_back
    return None


def _frame_self() -> Optional[nn.Module]:
    """The module whose method Dynamo is compiling, or None."""
    code, f_locals, resume = _compat.dynamo_frame()
    root = f_locals.get("self") if resume else _receiver(code, f_locals)
    if not isinstance(root, nn.Module) and resume:
        root = _caller_self(code)  # `self` unused after the break: the resumed method's frame still holds it
    return root if isinstance(root, nn.Module) else None


def frame_module() -> Optional[nn.Module]:
    """The module whose method Dynamo is compiling (for a resume function, the method it continues), else the
    outermost module running (a function the model calls); None when no module is running."""
    module = _frame_self()
    return module if module is not None else running_model()


def frame_root() -> Optional[Tuple[Tuple[str, type], ...]]:
    """The modules from the user's model down to the module whose method Dynamo is compiling, as (path,
    class) pairs outermost first (the model itself left out, as Dynamo leaves it out), or None when the frame
    is not a method of a submodule (the model's own forward, a plain function)."""
    root = _frame_self()
    if root is None:
        return None
    model = running_model()
    if model is None or model is root:
        return None
    path = next((name for name, module in model.named_modules() if module is root), None)
    if not path:
        return None
    parts = path.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return tuple((prefix, type(model.get_submodule(prefix))) for prefix in prefixes)


def anchor_module_stacks(gm: fx.GraphModule, root: Optional[Tuple[Tuple[str, type], ...]]) -> None:
    """Make every node's `nn_module_stack` start at the model: the modules down to the frame's root first,
    then the recorded modules with their paths prefixed by the root's path."""
    if not root:
        return
    path = root[-1][0]
    # every graph of the frame: an activation checkpoint's body is a graph module inside gm whose nodes the
    # planner reads once the body is inlined (rewrites/checkpoint_inline.py)
    for node in (n for graph in gm.modules() if isinstance(graph, fx.GraphModule) for n in graph.graph.nodes):
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        if f"{FRAME_ROOT_KEY}_0" in stack:
            continue
        anchored = {f"{FRAME_ROOT_KEY}_{depth}": entry for depth, entry in enumerate(root)}
        for key, (inner, inner_cls) in stack.items():
            anchored[key] = (f"{path}.{_relative(inner)}", inner_cls)
        node.meta["nn_module_stack"] = anchored


def _relative(dynamo_path: str) -> str:
    """Dynamo's "L['self'].gate" -> "gate" (kept as Dynamo spells the rest; clean_module_path tidies it)."""
    if dynamo_path.startswith("L["):
        end = dynamo_path.find("]")
        return dynamo_path[end + 1:].lstrip(".")
    return dynamo_path

"""Switching a compiled model between Megatron's two capture scopes at run time, without tracing it again.

Megatron-LM's `MoETransformerLayer.transition_cudagraph_scope(mode)` moves a layer between full-layer capture
('full': the whole layer in one graph, experts padded; used for inference and RL rollouts) and partial capture
('partial': the configured modules, e.g. the router and its preprocessing, with the token dispatch eager; used
for training). `transition_cudagraph_scope(model, mode)` is the same switch for a model compiled with the
backend: 'partial' is the compile options as given, 'full' the same options with `cuda_graph_modules=[]` (every
capture-safe span) and, with the local impl, `dynamic_padding="max"` where it was "off" (what lets an MoE layer's
expert loop be captured; Megatron pads the experts for the same reason).

How: the backend returns a `ScopedFrame` for each Dynamo graph. Dynamo traces once; each scope is planned from a
copy of that graph when a call first needs it, and keeps its compiled frame (its partitions, graphs and bank
policy) from then on, so switching back and forth replays the graphs each scope already has. A frame reads its
scope from its parameters (the one set for the module that owns its first parameter): one frame that
Dynamo shares between layers follows each layer's own scope.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from .config import CudaGraphConfig, CudaGraphImpl, DynamicPadding
from .config_values import ChoiceEnum, parse_enum
from .errors import ConfigError
from .native import SCOPE_GATE, compiled_host_path

__all__ = ["LayerScope", "ScopedFrame", "scope_config", "scope_of", "transition_cudagraph_scope"]

log = logging.getLogger("cgcompile")


class LayerScope(ChoiceEnum):
    """Megatron's names for what a layer captures (MoETransformerLayer.transition_cudagraph_scope's modes)."""

    FULL = "full"
    PARTIAL = "partial"


class _Scopes:
    """The scope set for each parameter and buffer (by identity), and a generation that any change bumps, so a
    frame re-reads its scope only after a transition."""

    def __init__(self) -> None:
        self.by_tensor: Dict[int, Tuple[weakref.ref, LayerScope]] = {}
        self.generation = 0

    def set(self, tensors: Sequence[torch.Tensor], scope: LayerScope) -> None:
        self.by_tensor = {key: entry for key, entry in self.by_tensor.items() if entry[0]() is not None}
        for t in tensors:
            self.by_tensor[id(t)] = (weakref.ref(t), scope)
        self.generation += 1

    def of(self, t: Optional[torch.Tensor]) -> LayerScope:
        entry = self.by_tensor.get(id(t)) if t is not None else None
        if entry is None or entry[0]() is not t:
            return LayerScope.PARTIAL  # never transitioned: the options as compiled
        return entry[1]


_SCOPES = _Scopes()


def transition_cudagraph_scope(model: torch.nn.Module, mode: Any) -> None:
    """Capture whole layers ("full") or the configured modules ("partial") in `model`'s compiled frames from
    their next call on. Cheap: each scope is planned once, at its first call, and keeps its graphs. Bad values
    raise one ConfigError before anything changes."""
    scope = parse_enum("transition_cudagraph_scope mode", mode, LayerScope)
    module = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: its model
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"transition_cudagraph_scope takes the model (an nn.Module, compiled or not), got "
                          f"{type(model).__name__}")
    _SCOPES.set(list(module.parameters()) + list(module.buffers()), scope)


def scope_of(module: torch.nn.Module) -> LayerScope:
    """The scope `module`'s frames use now (that of its first parameter or buffer)."""
    first = next(iter(module.parameters()), None)
    if first is None:
        first = next(iter(module.buffers()), None)
    return _SCOPES.of(first)


def scope_config(config: CudaGraphConfig, scope: LayerScope) -> CudaGraphConfig:
    """The options a scope compiles with: 'partial' the given ones; 'full' whole layers, with the local impl
    padding the expert loop ("max") unless a padding mode was chosen. Impls that do not select modules (none,
    full_iteration) are alike in both."""
    if scope is LayerScope.PARTIAL or config.cuda_graph_impl in (CudaGraphImpl.NONE, CudaGraphImpl.FULL_ITERATION):
        return config
    padding = config.dynamic_padding
    if padding is DynamicPadding.OFF and config.cuda_graph_impl is CudaGraphImpl.LOCAL:
        padding = DynamicPadding.MAX
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the options' own warnings were given when they were read
        return dataclasses.replace(config, cuda_graph_modules=(), dynamic_padding=padding)


class ScopedFrame:
    """One Dynamo graph, compiled per scope when a call first needs it: `build(scope, args)` plans and compiles
    the graph for a scope (args: the call's inputs, which stand in for Dynamo's example inputs). `probe` is the
    position of a parameter or buffer among the inputs whose scope the frame follows; `module` (held weakly)
    stands in when the graph reads none."""

    def __init__(self, build: Callable[[LayerScope, Sequence[Any]], Callable[..., Any]], probe: Optional[int],
                 module: Optional[torch.nn.Module]):
        self._build = build
        self._frames: Dict[LayerScope, Callable[..., Any]] = {}
        self._probe = probe
        self._module = weakref.ref(module) if module is not None else None
        self._token: Tuple[int, int] = (-1, -1)  # (generation, id of the probed tensor) of the last look-up
        self._scope = LayerScope.PARTIAL
        self._current: Optional[Callable[..., Any]] = None  # the frame that look-up found
        # what Dynamo calls: the same check in C where it is built (cgcompile/csrc/scope_gate.cpp), which calls the
        # frame the last look-up found and this object for any other call; else this object
        self.entry: Callable[..., Any] = self
        if SCOPE_GATE is not None and compiled_host_path():
            self.entry = SCOPE_GATE.ScopeGate(self, _SCOPES, -1 if probe is None else probe)

    def prepare(self, args: Sequence[Any]) -> None:
        """Compile the scope these inputs run in now (at Dynamo's compile, so its errors surface there)."""
        self._frame_for(args)

    def __call__(self, *args: Any) -> Any:
        probe = self._probe  # the last look-up's frame while its token holds (every step: one comparison)
        if (_SCOPES.generation, id(args[probe]) if probe is not None else 0) == self._token:
            return self._current(*args)
        return self._frame_for(args)(*args)

    def _frame_for(self, args: Sequence[Any]) -> Callable[..., Any]:
        probe = args[self._probe] if self._probe is not None else None
        token = (_SCOPES.generation, id(probe) if probe is not None else 0)
        scope = self._scope
        if token != self._token:
            if probe is not None:
                scope = _SCOPES.of(probe)
            else:
                module = self._module() if self._module is not None else None
                scope = scope_of(module) if module is not None else LayerScope.PARTIAL
        frame = self._frames.get(scope)
        if frame is None:
            if self._frames:
                log.info("cgcompile: capture scope %r reached a compiled graph for the first time: planning it for "
                         "that scope from Dynamo's trace (no new trace); the graphs of scope %s stay for when it "
                         "comes back", scope.value, " and ".join(repr(s.value) for s in self._frames))
            frame = self._frames[scope] = self._build(scope, args)
        # kept only once the frame exists (a build that raised is tried again at the next call)
        self._token, self._scope, self._current = token, scope, frame
        if self.entry is not self:
            self.entry.follow(token[0], token[1], frame)
        return frame

    @property
    def scopes(self) -> Tuple[LayerScope, ...]:
        """The scopes compiled so far, in the order they were first used."""
        return tuple(self._frames)

    @property
    def runtime(self) -> Any:
        """The ModelRuntime of the current scope's frame (for tests and tools), if it has one."""
        return getattr(self._frames.get(self._scope), "runtime", None)

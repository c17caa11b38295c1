"""Whole-step capture: `capture_step` (forward, backward and optimizer step as one graph), and the check that
decides whether a frame can be one graph at all (`full_iteration` in the backend uses the plan for that).

The recipe is torch's whole-network capture: a few eager warmup steps (optimizer state must exist before
capture, and lazy library init must not happen inside one), then one capture on static input buffers; each
later call copies the batch into those buffers, replays, and returns copies of the static outputs.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ... import _compat, counters
from ...errors import ConfigError
from ..bank import policy as bank_policy
from ..drivers.base import Driver
from ...devices import device_of
from ..drivers.select import get_driver
from .optimizer_values import OptimizerValues, changed_value
from ..drivers.host_sync import host_sync_reason
from ..release import register
from ..drivers.user_frames import user_location

log = logging.getLogger("cgcompile")

__all__ = ["CapturedStep", "capture_step"]

_DRIVERS = ("auto", "cuda", "emulate", "eager")


class _StepChecker(_compat.TorchDispatchMode):
    """Runs one eager step and records every op that a capture would reject, with the user's file:line."""

    def __init__(self, on_cuda: bool):
        super().__init__()
        self.on_cuda = on_cuda
        self.problems: Dict[Tuple[str, str], None] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = host_sync_reason(func, args, kwargs, self.on_cuda)
        if reason is not None:
            self.problems.setdefault((user_location(), reason))
        return func(*args, **kwargs)


def _check_optimizer(optimizer: torch.optim.Optimizer, *_args: Any, **_kwargs: Any) -> None:
    """Optimizers that keep their step count on the host cannot be replayed: they need capturable=True."""
    for index, group in enumerate(optimizer.param_groups):
        if "capturable" in group and not group["capturable"]:
            raise ConfigError(
                f"capture_step: {type(optimizer).__name__} param group {index} has capturable=False; a captured "
                f"step cannot update its host-side step count. Construct it with capturable=True, e.g. "
                f"torch.optim.{type(optimizer).__name__}(params, ..., capturable=True)")


def _step_key(args: Sequence[Any]) -> tuple:
    return (torch.is_grad_enabled(),) + tuple(
        (tuple(a.shape), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else ("const", a)
        for a in args)


class _Captured:
    """One captured variant of the step (per input signature and grad mode)."""

    def __init__(self) -> None:
        self.calls = 0
        self.graph = None
        self.static_inputs: List[torch.Tensor] = []
        self.out_spec = None
        self.values: tuple = ()  # the optimizers' plain hyperparameters at capture (runtime/frame/optimizer_values.py)
        self.replays = 0  # since its capture (the capture call's own replay included)
        self.recapture_streak = 0
        self.eager: Optional[str] = None  # why this variant runs eagerly for good


class CapturedStep:
    """A training (or validation) step captured as one graph. Call it like the step function."""

    def __init__(self, step_fn: Callable[..., Any], *, warmup_steps: int = 3, driver: str = "auto"):
        if driver not in _DRIVERS:
            raise ConfigError(f"capture_step: driver={driver!r} is not valid; choose one of {', '.join(_DRIVERS)}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ConfigError(f"capture_step: warmup_steps={warmup_steps!r} must be an int >= 1: optimizer state "
                              f"and lazy library init must exist before the step is captured")
        self.step_fn = step_fn
        self.warmup_steps = warmup_steps
        self.driver_name = driver
        self._variants: Dict[tuple, _Captured] = {}
        self._driver: Optional[Driver] = None
        self._pool: Any = None
        self._values = OptimizerValues()
        register(self)

    def release(self) -> None:
        """Drop the captured step graphs, driver and pool (cgcompile.release()); the next calls warm up and
        capture again."""
        self._variants = {}
        if self._driver is not None:
            self._driver.release()
        self._driver = self._pool = None

    def _driver_for(self, args: Sequence[Any]) -> Driver:
        if self._driver is None:
            self._driver = get_driver(self.driver_name, device_of(args))
            self._pool = self._driver.new_pool()
        return self._driver

    def __call__(self, *args: Any) -> Any:
        driver = self._driver_for(args)
        variant = self._variants.setdefault(_step_key(args), _Captured())
        variant.calls += 1
        if not driver.captures:
            return self._checked_eager_step(args, driver) if variant.calls == 1 else self.step_fn(*args)
        if variant.calls <= self.warmup_steps:
            with driver.warmup_stream():
                if variant.calls == 1:
                    return self._checked_eager_step(args, driver)
                return self._watched_step(args)
        if variant.eager is not None:
            return self.step_fn(*args)
        if variant.graph is None:
            self._capture(variant, args, driver)
        else:
            change = changed_value(variant.values, self._values.snapshot())
            if change is not None and not self._recapture(variant, args, driver, change):
                return self.step_fn(*args)
        variant.replays += 1
        with torch.no_grad():
            for static, new in zip(variant.static_inputs, args):
                if isinstance(static, torch.Tensor) and static is not new:
                    static.copy_(new)
        outputs = variant.graph.replay()
        counters.add_replays(1, variant.replays > 1)
        copies = [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs]
        return _compat.tree_unflatten(copies, variant.out_spec)

    def _checked_eager_step(self, args: Sequence[Any], driver: Driver) -> Any:
        """The first call runs eagerly under checks, so a step that cannot be captured fails here, clearly."""
        on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        handle = register_optimizer_step_pre_hook(_check_optimizer)
        try:
            with _StepChecker(on_cuda) as checker:
                out = self._watched_step(args)
        finally:
            handle.remove()
        if checker.problems and driver.captures:
            lines = "\n".join(f"  {where}: {reason}" for where, reason in checker.problems)
            raise ConfigError(f"capture_step: the step cannot be captured as one graph; it syncs with the host:\n"
                              f"{lines}\nMove these out of the step (log the loss after it returns) or use "
                              f"torch.compile(..., backend='cudagraph_modules') to capture around them.")
        return out

    def _watched_step(self, args: Sequence[Any]) -> Any:
        """An eager step that notes which optimizers it steps (their hyperparameters are checked at replay)."""
        handle = register_optimizer_step_pre_hook(lambda optimizer, *_: self._values.saw_step(optimizer))
        try:
            return self.step_fn(*args)
        finally:
            handle.remove()

    def _recapture(self, variant: _Captured, args: Sequence[Any], driver: Driver, change: str) -> bool:
        """An optimizer hyperparameter the graph baked in changed: capture again (False: run eagerly for good,
        when it changes about every step)."""
        variant.recapture_streak = bank_policy.recapture_streak(variant.recapture_streak, variant.replays)
        reason = (f"{change} since the step was captured (a CUDA graph replays the value it captured); "
                  f"{_TENSOR_HINT}")
        if bank_policy.storm(variant.recapture_streak):
            variant.eager = reason
            variant.graph = None
            counters.record("eager_fallbacks", "capture_step", f"re-captured {variant.recapture_streak} times in a "
                            f"row without a replay in between: {reason}", once=True)
            log.warning("capture_step: the step runs eagerly from now on: its optimizer hyperparameters change "
                        "about every step (%s)", reason)
            return False
        counters.record("recaptures", "capture_step", reason)
        log.info("capture_step: capturing the step again: %s", reason)
        self._pool = driver.new_pool()  # the old graph's pool may still be held by its outputs
        self._capture(variant, args, driver)
        return True

    def _capture(self, variant: _Captured, args: Sequence[Any], driver: Driver) -> None:
        variant.static_inputs = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        grad = torch.is_grad_enabled()

        def run(static_inputs: list) -> list:
            with torch.set_grad_enabled(grad):
                flat, variant.out_spec = _compat.tree_flatten(self.step_fn(*static_inputs))
            return flat

        start = time.perf_counter()
        variant.values = self._values.snapshot()
        variant.replays = 0
        variant.graph = driver.capture(run, variant.static_inputs, self._pool, warmup=False)
        elapsed = time.perf_counter() - start
        counters.add("graphs_captured")
        counters.add("capture_seconds", elapsed)
        counters.add("pool_bytes", variant.graph.pool_bytes)
        log.info("capture_step: captured the %s step in %.2f s", "training" if grad else "forward-only", elapsed)


_TENSOR_HINT = ("a value that changes every few steps is better given as a tensor the optimizer reads on the device, "
                "which the graph reads at each replay and torch's schedulers update in place: e.g. torch.optim.AdamW("
                "params, lr=torch.tensor(1e-3, device='cuda'), capturable=True) (SGD reads a tensor lr on the host)")


def capture_step(step_fn: Callable[..., Any], *, warmup_steps: int = 3, driver: str = "auto") -> CapturedStep:
    """Capture a whole training step (forward, `loss.backward()`, `optimizer.step()`) as one graph.

    The tensors passed in are copied into static buffers on every call; the returned tensors are copies of the
    static outputs. Optimizers must be built with `capturable=True` where they have that option, and the step
    must not sync with the host (`.item()`, `.cpu()`, data-dependent shapes): both are checked on the first
    call, which runs eagerly, and reported in one ConfigError. The first `warmup_steps` calls run eagerly.
    Calls under `torch.no_grad()` (validation) get their own forward-only graph. An optimizer hyperparameter
    given as a Python number (a scheduler's lr) is baked into the graph: when it changes the step is captured
    again, and runs eagerly if it changes about every step; give it as a tensor to avoid both.
    """
    return CapturedStep(step_fn, warmup_steps=warmup_steps, driver=driver)

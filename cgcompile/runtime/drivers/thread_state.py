"""Thread-local state that tracing, warmup and capture must leave as they found it.

Running a partition outside its frame (aot_autograd tracing it, the driver's warmup run, an emulated capture)
can leave grad mode, autocast, a functorch level or the default dtype changed, and every run draws random
numbers. The runtime wraps that work in `preserved_global_state()`, so the caller's next op sees what eager
would have left, and the draws a replay makes are the draws eager would make.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Tuple

import torch

from ... import _compat

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class GlobalState:
    """What eager code can observe of the thread's state between ops (random generators apart)."""

    grad_enabled: bool
    autocast: Tuple[Tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    default_dtype: torch.dtype
    functorch_level: int

    @classmethod
    def now(cls) -> "GlobalState":
        return cls(torch.is_grad_enabled(),
                   tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES),
                   torch.is_autocast_cache_enabled(), torch.get_default_dtype(), _compat.functorch_level())

    def restore(self) -> None:
        while _compat.functorch_level() > self.functorch_level:
            _compat.pop_functorch_level()
        torch.set_grad_enabled(self.grad_enabled)
        for device, enabled, dtype in self.autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.autocast_cache)
        torch.set_default_dtype(self.default_dtype)


def _cuda_devices() -> List[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() else []


@dataclass(frozen=True)
class RngState:
    """The CPU default generator and every initialized CUDA device's default generator."""

    cpu: torch.Tensor
    cuda: Tuple[Tuple[int, torch.Tensor], ...]

    @classmethod
    def now(cls) -> "RngState":
        return cls(torch.get_rng_state(), tuple((i, torch.cuda.get_rng_state(i)) for i in _cuda_devices()))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for index, state in self.cuda:
            torch.cuda.set_rng_state(state, index)


@contextlib.contextmanager
def preserved_global_state(rng: bool = False) -> Iterator[None]:
    """Run the body, then put back the global state (and with `rng`, the random generators) as they were,
    whether it returned or raised."""
    state = GlobalState.now()
    generators = RngState.now() if rng else None
    try:
        yield
    finally:
        state.restore()
        if generators is not None:
            generators.restore()

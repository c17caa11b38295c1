"""Everything one run of a model can change, snapshotted before and put back after: what keeps `explain()` free
of side effects.

explain() has to run the model: Dynamo traces a frame by running it, and the Python between two graphs (after a
graph break: a `.tolist()`, a loop over `nonzero()`) runs on real values. Tracing on fake tensors instead would
fail at exactly those breaks, which explain() exists to report, so the run stays real and its effects are undone:

- tensor contents: every storage behind the model's parameters, buffers and gradients and behind the tensors in
  the arguments (inside lists, dicts and objects such as a KV cache), copied to host memory before the run and
  written back where they changed (BatchNorm's running statistics, a counting buffer, a cache written in place,
  whatever the code or a graph-break region wrote, through any view or `.data` alias);
- bindings: which tensor each parameter, buffer and `.grad` name refers to (a buffer reassigned in forward), and
  the modules' plain attributes (numbers, strings, flags such as `training`);
- random generators: the CPU and every initialized CUDA device's default generator, `torch.Generator` objects in
  the arguments, Python's `random` and NumPy's global generator.

Not restored: Python objects inside arguments other than their tensors' contents (a cache object's lists that a
run appended to), and tensors' version counters (a write during the run still counts for autograd).
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Dict, Iterator, List, Tuple

import torch

from .runtime.drivers.thread_state import RngState

__all__ = ["ModelState", "preserved_model_state"]

_PLAIN = (int, float, bool, str, type(None))
_MISSING = object()
_MAX_DEPTH = 6  # how deep the argument walk goes into containers and objects


def _storage_bytes(t: torch.Tensor) -> Any:
    """A uint8 tensor aliasing all of t's storage, or None when it has none to copy (meta, empty, a subclass)."""
    if t.device.type == "meta" or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)


class _ArgumentWalk:
    """The tensors and generators reachable from a call's arguments: containers, objects' attributes, modules."""

    def __init__(self) -> None:
        self.tensors: List[torch.Tensor] = []
        self.generators: List[torch.Generator] = []
        self.modules: List[torch.nn.Module] = []
        self._seen: set = set()

    def visit(self, value: Any, depth: int = 0) -> None:
        if depth > _MAX_DEPTH or isinstance(value, _PLAIN) or id(value) in self._seen:
            return
        self._seen.add(id(value))
        if isinstance(value, torch.Tensor):
            self.tensors.append(value)
        elif isinstance(value, torch.Generator):
            self.generators.append(value)
        elif isinstance(value, torch.nn.Module):
            self.modules.extend(value.modules())
        elif isinstance(value, dict):
            for item in value.values():
                self.visit(item, depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                self.visit(item, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
            for item in vars(value).values():
                self.visit(item, depth + 1)


class ModelState:
    """A snapshot of what a run of `model_or_fn(*args, **kwargs)` can change; `restore()` puts it back."""

    def __init__(self, model_or_fn: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        walk = _ArgumentWalk()
        walk.visit(model_or_fn)
        walk.visit(getattr(model_or_fn, "__self__", None))  # a bound method of a module
        walk.visit((args, kwargs))
        self.modules = list(dict.fromkeys(walk.modules))
        self.bindings = [(m, dict(m.named_parameters(recurse=False)), dict(m.named_buffers(recurse=False)),
                          {k: v for k, v in vars(m).items() if isinstance(v, _PLAIN)}) for m in self.modules]
        params = [p for m in self.modules for p in m.parameters(recurse=False)]
        self.grads = [(p, p.grad) for p in params]
        tensors = params + [b for m in self.modules for b in m.buffers(recurse=False)] + walk.tensors
        tensors += [g for _, g in self.grads if g is not None]
        self.storages: Dict[Tuple[str, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        for t in tensors:
            alias = _storage_bytes(t)
            if alias is not None:
                key = (str(alias.device), alias.data_ptr())
                if key not in self.storages:
                    self.storages[key] = (alias, alias.to("cpu", copy=True))
        self.rng = RngState.now()
        self.generators = [(g, g.get_state()) for g in walk.generators]
        self.python_random = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy_random = (numpy, numpy.random.get_state()) if numpy is not None else None

    def restore(self) -> None:
        for module, params, buffers, plain in self.bindings:
            self._rebind(module, params, dict(module.named_parameters(recurse=False)), module.register_parameter)
            self._rebind(module, buffers, dict(module.named_buffers(recurse=False)), module.register_buffer)
            for name, value in list(vars(module).items()):
                if isinstance(value, _PLAIN) and name not in plain:
                    delattr(module, name)  # a plain attribute the run added
            for name, value in plain.items():
                current = vars(module).get(name, _MISSING)
                if type(current) is not type(value) or current != value:
                    setattr(module, name, value)
        for param, grad in self.grads:
            if param.grad is not grad:
                param.grad = grad
        with torch.no_grad():
            for alias, saved in self.storages.values():
                if not torch.equal(alias.to("cpu"), saved):
                    alias.copy_(saved)
        self.rng.restore()
        for generator, state in self.generators:
            generator.set_state(state)
        random.setstate(self.python_random)
        if self.numpy_random is not None:
            numpy, state = self.numpy_random
            numpy.random.set_state(state)

    @staticmethod
    def _rebind(module: torch.nn.Module, before: Dict[str, Any], now: Dict[str, Any], register: Any) -> None:
        """Parameters or buffers bound to other tensors, added or removed during the run: as before (a name the
        run removed is registered again)."""
        for name in now.keys() - before.keys():
            delattr(module, name)
        for name, value in before.items():
            if name not in now:
                register(name, value)
            elif now[name] is not value:
                setattr(module, name, value)


@contextlib.contextmanager
def preserved_model_state(model_or_fn: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Iterator[None]:
    """Run the body, then leave the model, its arguments and the random generators as they were (returned or
    raised)."""
    state = ModelState(model_or_fn, args, kwargs)
    try:
        yield
    finally:
        state.restore()

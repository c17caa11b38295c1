"""make_graphed_callables' contract on the CPU, for testing the transformer_engine glue (te.py) without a GPU.

TE's `make_graphed_callables` and torch's (torch/cuda/graphs.py, read on 2.11 and 2.13; TE follows the same
contract) give each callable ONE static instance: a forward graph and a backward graph captured once, all
callables' graphs in one memory pool (forwards in order, then backwards in reverse). What follows, and what this
emulation reproduces, is what the glue must cope with:
- Inputs: the sample tensors are the graphs' static inputs; a call copies an argument into its sample unless both
  share an address (so a parameter whose sample shares its memory is never copied).
- Outputs: every call returns detached views of the same static output tensors; the next call overwrites them,
  and so does any earlier-captured graph of the pool (its temporaries may lie where they live).
- Gradients: the backward copies incoming gradients into static buffers, replays, and returns detached views of
  static gradient buffers, one per input. Autograd may make such a buffer a parameter's `.grad` as it is (it
  steals a gradient nobody else references), which the next replays then overwrite.
- A second forward before the first backward overwrites the activations that backward reads: both backwards
  compute the gradients of the latest forward.
- Refusals: non-tensor sample arguments, modules with hooks, buffers requiring grad, and an active autocast with
  its weight cache on ("make_graphed_callables does not support the autocast caching").
- A module callable is returned with its forward replaced; that forward runs the graphs only in the
  training mode it was graphed in.
The "replays" run the callable on the static inputs with autograd (the gradients come from the latest forward's
graph, as a replayed backward reads the latest forward's activations) and copy the results into the static
buffers; memory a replay would overwrite on a GPU is filled with NaN (or max values) instead.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ... import _compat
from ..drivers.emulated_pool import EmulatedPool, PoolSlot, poison

__all__ = ["emulated_make_graphed_callables"]

AUTOCAST_CACHE_MESSAGE = ("make_graphed_callables does not support the autocast caching. Please set "
                          "`cache_enabled=False`.")  # torch's own message (2.11, 2.13)


class _Instance:
    """One callable's static forward and backward "graphs"."""

    def __init__(self, fn: Callable[..., Any], args: Tuple[Any, ...], surface: Tuple[torch.Tensor, ...],
                 allow_unused: bool):
        # a module's own forward: graphing replaces the module's forward, and a "replay" re-runs what was captured
        fn = fn.forward if isinstance(fn, torch.nn.Module) else fn
        self.fn, self.args, self.surface, self.allow_unused = fn, args, surface, allow_unused
        self.len_user_args = len(_compat.tree_flatten(args)[0])
        with torch.enable_grad():
            outputs, self.spec = _compat.tree_flatten(fn(*args))
        self.requires_grad = [o.requires_grad for o in outputs]
        taken = {t.untyped_storage().data_ptr() for t in surface}
        # an output that is (a view of) an input stays that view; the others live in the pool
        self.static_outputs = [o.detach() if o.untyped_storage().data_ptr() in taken else torch.empty_like(o)
                               for o in outputs]
        self.fwd_position = -1
        self.bwd_position = -1
        self.slots: List[PoolSlot] = []  # its memory in the pool, forward then backward
        self.latest: List[torch.Tensor] = []
        self.static_grad_outputs: List[Optional[torch.Tensor]] = []
        self.static_grad_inputs: List[Optional[torch.Tensor]] = []
        self._capture_outputs = outputs  # the backward capture's autograd graph; dropped after it

    def pool_outputs(self) -> List[Optional[torch.Tensor]]:
        taken = {t.untyped_storage().data_ptr() for t in self.surface}
        return [o for o in self.static_outputs if o.untyped_storage().data_ptr() not in taken]

    def capture_backward(self) -> None:
        outputs, self._capture_outputs = self._capture_outputs, []
        self.static_grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in outputs]
        grads: Sequence[Optional[torch.Tensor]] = ()
        wanted = [o for o in outputs if o.requires_grad]
        if wanted:
            grads = torch.autograd.grad(wanted, [s for s in self.surface if s.requires_grad],
                                        grad_outputs=[torch.zeros_like(o) for o in wanted],
                                        allow_unused=self.allow_unused)
        found = iter(grads)
        self.static_grad_inputs = [None if not (s.requires_grad and wanted) else _empty_like(next(found))
                                   for s in self.surface]
        poison(self.static_outputs)
        poison(self.static_grad_inputs)

    def replay_forward(self, inputs: Sequence[torch.Tensor], pool: EmulatedPool) -> Tuple[torch.Tensor, ...]:
        with torch.no_grad():
            for i in range(self.len_user_args):
                if self.surface[i].data_ptr() != inputs[i].data_ptr():
                    self.surface[i].copy_(inputs[i])
        args = _compat.tree_unflatten(list(self.surface[:self.len_user_args]), _compat.tree_flatten(self.args)[1])
        with torch.enable_grad():
            self.latest = _compat.tree_flatten(self.fn(*args))[0]
        with torch.no_grad():
            for static, new in zip(self.static_outputs, self.latest):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
        pool.replayed(self.fwd_position)
        return tuple(o.detach() for o in self.static_outputs)

    def replay_backward(self, grads: Sequence[Optional[torch.Tensor]], pool: EmulatedPool) -> Tuple[Any, ...]:
        with torch.no_grad():
            for static, grad in zip(self.static_grad_outputs, grads):
                if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                    static.copy_(grad)
        wanted = [o for o, rg in zip(self.latest, self.requires_grad) if rg]
        if wanted:
            # retain_graph: a second backward of one forward reads the same activations again, as a replay does
            new = torch.autograd.grad(wanted, [s for s in self.surface if s.requires_grad],
                                      grad_outputs=[g for g in self.static_grad_outputs if g is not None],
                                      retain_graph=True, allow_unused=self.allow_unused)
            found = iter(new)
            with torch.no_grad():
                for static, s in zip(self.static_grad_inputs, self.surface):
                    if s.requires_grad:
                        value = next(found)
                        if static is not None and value is not None:
                            static.copy_(value)
        pool.replayed(self.bwd_position)
        return tuple(b.detach() if b is not None else None for b in self.static_grad_inputs)


def _empty_like(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else torch.empty_like(t)


def _graphed(instance: _Instance, pool: EmulatedPool, module_params: Tuple[torch.Tensor, ...]) -> Callable[..., Any]:
    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
            return instance.replay_forward(inputs, pool)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Any, ...]:
            return instance.replay_backward(grads, pool)

    def functionalized(*user_args: Any) -> Any:
        flat = _compat.tree_flatten(user_args)[0]
        return _compat.tree_unflatten(list(Graphed.apply(*flat, *module_params)), instance.spec)

    return functionalized


def _check(fn: Any, args: Tuple[Any, ...]) -> None:
    if isinstance(fn, torch.nn.Module):
        if fn._backward_hooks or fn._forward_hooks or fn._forward_pre_hooks:
            raise AssertionError("Modules must not have hooks registered at the time they are passed.")
        if any(b.requires_grad for b in fn.buffers()):
            raise AssertionError("only parameters may be trainable; all buffers must have requires_grad=False")
    if not all(isinstance(a, torch.Tensor) for a in _compat.tree_flatten(args)[0]):
        raise AssertionError("sample_args for each callable must contain only Tensors")


def emulated_make_graphed_callables(callables: Any, sample_args: Any, *, num_warmup_iters: int = 3,
                                    allow_unused_input: bool = False, **unused: Any) -> Any:
    """make_graphed_callables (torch's, TE's) as the module docstring describes, on the CPU. TE-only arguments
    (fp8_enabled, fp8_recipe, ...) are accepted and ignored."""
    if any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")) and torch.is_autocast_cache_enabled():
        raise RuntimeError(AUTOCAST_CACHE_MESSAGE)
    single = not isinstance(callables, tuple)
    fns = (callables,) if single else tuple(callables)
    samples = (tuple(sample_args),) if single else tuple(tuple(a) for a in sample_args)
    for fn, args in zip(fns, samples):
        _check(fn, args)
    params = [tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else () for fn in fns]
    surfaces = [tuple(_compat.tree_flatten(args)[0]) + p for args, p in zip(samples, params)]
    for fn, args, surface in zip(fns, samples, surfaces):  # warmup, as torch does (on a side stream there)
        for _ in range(num_warmup_iters):
            with torch.enable_grad():
                outputs = [o for o in _compat.tree_flatten(fn(*args))[0] if o.requires_grad]
            if outputs:
                torch.autograd.grad(outputs, [s for s in surface if s.requires_grad],
                                    grad_outputs=[torch.empty_like(o) for o in outputs], allow_unused=allow_unused_input)
    pool = EmulatedPool()
    instances = [_Instance(fn, args, surface, allow_unused_input) for fn, args, surface in zip(fns, samples, surfaces)]
    for instance in instances:  # forwards in order
        instance.slots.append(PoolSlot(instance.pool_outputs()))
        instance.fwd_position = pool.add(instance.slots[-1])
    for instance in reversed(instances):  # then backwards in reverse
        instance.capture_backward()
        instance.slots.append(PoolSlot(instance.static_grad_inputs))
        instance.bwd_position = pool.add(instance.slots[-1])
    graphed: List[Any] = []
    for fn, instance, p in zip(fns, instances, params):
        functionalized = _graphed(instance, pool, p)
        if isinstance(fn, torch.nn.Module):
            fn.forward = _training_dispatch(fn, fn.training, functionalized, fn.forward)
            graphed.append(fn)
        else:
            graphed.append(functionalized)
    return graphed[0] if single else tuple(graphed)


def _training_dispatch(module: torch.nn.Module, training: bool, graphed: Callable[..., Any],
                       original: Callable[..., Any]) -> Callable[..., Any]:
    """A graphed module's forward: the graphs in the training mode they were captured in, else its own forward."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        return (graphed if module.training == training else original)(*args, **kwargs)
    return forward

"""Frame outputs copied out of graph memory in as few kernels as CUDA allows.

A frame's outputs that live in a captured graph's memory are copied out as they leave it (`clone_outputs`), so
the next replay cannot overwrite what the caller holds. A training frame of a Hugging Face model returns several:
the logits, the loss, each layer's key and value tensors. One `clone` each is a kernel each; CUDA copies a list of
tensors of one dtype in one multi-tensor kernel (`torch._foreach_copy_`, one launch when the destinations have
the sources' sizes and strides, which `empty_like` gives). So outputs sharing a device and dtype are copied
together; a tensor alone in its group is copied by itself (cloned, where no gradient is wanted).

`_foreach_copy_` has no autograd formula, and a training frame's outputs carry the gradient back into the graphs
that made them: the copy runs inside one autograd Function whose backward hands each gradient through unchanged,
as `clone`'s does, and gives an output that got no gradient (the logits beside the loss) zeros made as autograd
would, but marked, so that a backward graph need not copy them in (zero_grads.py).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from .zero_grads import layout_of, zeros_for

__all__ = ["copy_out"]


def copy_out(tensors: Sequence[torch.Tensor], zeros: bool = False) -> List[torch.Tensor]:
    """Copies of `tensors` (plain tensors) with their layouts, in one kernel per device and dtype shared by two
    or more of them; the copies carry autograd history as `clone` would, with `zeros`, an output's missing
    gradient given as zeros_for's."""
    groups = _groups(tensors)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_CopiesOut.apply(groups, zeros, *tensors))
    if all(len(members) < 2 for members in groups.values()):
        return [t.clone() for t in tensors]
    return _copies(tensors, groups)


def _groups(tensors: Sequence[torch.Tensor]) -> Dict[Tuple[Any, Any], List[int]]:
    groups: Dict[Tuple[Any, Any], List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _copies(tensors: Sequence[torch.Tensor], groups: Dict[Tuple[Any, Any], List[int]]) -> List[torch.Tensor]:
    out = [torch.empty_like(t) for t in tensors]  # preserve_format: the source's strides where it is dense
    for members in groups.values():
        if len(members) == 1:
            out[members[0]].copy_(tensors[members[0]])
        else:
            torch._foreach_copy_([out[i] for i in members], [tensors[i] for i in members])
    return out


class _CopiesOut(torch.autograd.Function):
    """The grouped copy for outputs that need gradients: forward copies, backward passes each gradient on."""

    @staticmethod
    def forward(ctx: Any, groups: Dict[Tuple[Any, Any], List[int]], zeros: bool,
                *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.layouts = [layout_of(t) if zeros and t.requires_grad and t.layout == torch.strided else None
                       for t in tensors]
        out = _copies(tensors, groups)
        # an output whose source needs no gradient needs none either (as with `clone`)
        ctx.mark_non_differentiable(*[o for o, t in zip(out, tensors) if not t.requires_grad])
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Tuple[Any, ...]:
        layouts = ctx.layouts
        passed = [zeros_for(layouts[i]) if g is None and layouts[i] is not None else g
                  for i, g in enumerate(grads)]
        return (None, None, *passed)  # none for the groups and the zeros

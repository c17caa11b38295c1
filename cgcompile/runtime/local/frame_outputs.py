"""Frame outputs copied out of graph memory in as few kernels as CUDA allows.

A frame's outputs that live in a captured graph's memory are copied out as they leave it (`clone_outputs`), so
the next replay cannot overwrite what the caller holds. A training frame of a Hugging Face model returns several:
the logits, the loss, each layer's key and value tensors. One `clone` each is a kernel each; CUDA copies a list of
tensors of one dtype in one multi-tensor kernel (`torch._foreach_copy_`, one launch when the destinations have
the sources' sizes and strides, which `empty_like` gives). So outputs sharing a device and dtype are copied
together; a tensor alone in its group is copied by itself (cloned, where no gradient is wanted).

A copy moves bits, so outputs of different dtypes (the bf16 logits beside the fp32 loss) need not cost a kernel
each: dense outputs whose last dimension is contiguous (or scalars) of one element size are copied as integers of
that size (`Tensor.view(dtype)` reinterprets, exactly, NaN payloads included), in one kernel, and a small one (the
loss) joins the narrowest size a large one has. A large tensor is never copied narrower than its elements, and a
group of one dtype copies in that dtype.

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


# the integer dtype a copy of mixed dtypes runs in, by element size
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# a tensor this small (the loss, a token) may be copied as narrower integers than its own: a wide tensor is not (a
# multi-tensor copy moves a fixed number of elements per thread, so narrower elements move fewer bytes per load)
_SMALL_BYTES = 4096


def _groups(tensors: Sequence[torch.Tensor]) -> Dict[Tuple[Any, Any], List[int]]:
    """Indices of `tensors` copied together, by (device, the dtype the copy runs in): per device, the viewable
    ones (_viewable) by element size, small ones joining the narrowest size a large one has (each group in its
    dtype where it has one, else as integers of its size); the others by dtype."""
    groups: Dict[Tuple[Any, Any], List[int]] = {}
    widths: Dict[Any, Dict[int, List[int]]] = {}
    for i, t in enumerate(tensors):
        if _viewable(t):
            widths.setdefault(t.device, {}).setdefault(t.element_size(), []).append(i)
        else:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for device, by_width in widths.items():
        large = [w for w, members in by_width.items() if any(_nbytes(tensors[i]) > _SMALL_BYTES for i in members)]
        target = min(large or by_width)
        for width in [w for w in by_width if w != target and w % target == 0]:
            small = [i for i in by_width[width] if _nbytes(tensors[i]) <= _SMALL_BYTES]
            by_width[target] += small
            by_width[width] = [i for i in by_width[width] if i not in small]
        for width, members in by_width.items():
            dtypes = {tensors[i].dtype for i in members}
            key = (device, dtypes.pop() if len(dtypes) == 1 else _BITS[width])
            groups.setdefault(key, []).extend(members)
    return {key: members for key, members in groups.items() if members}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _viewable(t: torch.Tensor) -> bool:
    """Can `t` and its `empty_like` be viewed as integers of a smaller element size, with equal strides?"""
    return (t.layout == torch.strided and not t.is_complex() and not t.is_quantized and t.element_size() in _BITS
            and (t.dim() == 0 or t.stride(-1) == 1) and _dense(t))


def _dense(t: torch.Tensor) -> bool:
    """Are `t`'s elements one block without gaps or overlaps (so `empty_like` keeps its strides)?"""
    expected = 1
    for size, stride in sorted((p for p in zip(t.shape, t.stride()) if p[0] != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return t.numel() > 0


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t`'s memory as `dtype` (a scalar as one element)."""
    if t.dtype == dtype:
        return t
    return (t.view(1) if t.dim() == 0 else t).view(dtype)


def _copies(tensors: Sequence[torch.Tensor], groups: Dict[Tuple[Any, Any], List[int]]) -> List[torch.Tensor]:
    out = [torch.empty_like(t) for t in tensors]  # preserve_format: the source's strides where it is dense
    for (_, dtype), members in groups.items():
        if len(members) == 1:
            out[members[0]].copy_(tensors[members[0]])
        else:
            torch._foreach_copy_([_as(out[i], dtype) for i in members], [_as(tensors[i], dtype) for i in members])
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

"""Copies into and out of graph buffers that keep any tensor layout: expanded (stride 0), non-contiguous,
with a storage offset, or empty.

A CUDA graph reads and writes fixed addresses, so a static buffer must have its argument's exact strides (the
captured kernels were specialised for them). An expanded tensor repeats one element along its stride-0
dimensions; `copy_` refuses such a destination ("more than one element of the written-to tensor refers to a
single memory location"), so a copy writes only the *core*: the tensor with each stride-0 dimension narrowed
to one element, which holds every distinct element exactly once.
"""

from __future__ import annotations

from typing import Optional

import torch


def broadcast_core(t: torch.Tensor) -> torch.Tensor:
    """t with each stride-0 dimension narrowed to length 1: every distinct element once."""
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            t = t.narrow(dim, 0, 1)
    return t


def overlaps_itself(t: torch.Tensor) -> bool:
    """Could two elements of t share memory? Conservative: False means surely not."""
    span = 0
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def uncopyable_reason(t: torch.Tensor) -> Optional[str]:
    """Why no static buffer can stand for t, or None: only overlap that is not a plain repeat (a sliding window
    built with as_strided) is left."""
    if overlaps_itself(broadcast_core(t)):
        return (f"its memory overlaps itself (strides {tuple(t.stride())} for shape {tuple(t.shape)}, e.g. from "
                f"as_strided or unfold), which no static buffer can mirror; pass .contiguous() there")
    return None


def same_repeats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b repeat along the same dimensions (b's values fit a's buffer layout)."""
    return all((sa == 0) == (sb == 0) for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def static_copy(t: torch.Tensor) -> torch.Tensor:
    """A buffer with t's exact shape and strides (stride 0 kept), holding t's values."""
    buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    copy_into(buf, t)
    return buf


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a dst of any layout: an expanded dst gets src's core written once. The caller makes
    sure src repeats along dst's stride-0 dimensions (same_repeats), as its values are then equal there."""
    core = broadcast_core(dst)
    if core is dst:
        dst.copy_(src)
    elif not same_repeats(dst, src):
        raise RuntimeError(f"cannot copy a tensor with strides {tuple(src.stride())} into a buffer that repeats "
                           f"along its stride-0 dimensions (strides {tuple(dst.stride())})")
    else:
        core.copy_(src[tuple(slice(0, n) for n in core.shape)])

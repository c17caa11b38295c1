"""Zeros for the frame outputs that get no gradient, which a backward graph need not copy in again.

A Hugging Face model's training frame returns the logits and, with `use_cache`, each layer's key and value
beside the loss, and the backward seeds only the loss. Autograd then hands the partitions that made the others
new zeros every step, and each partition's backward graph copied them into its static buffers: a copy kernel
each, and beside the loss's fp32 gradient, bf16 zeros split CUDA's multi-tensor copy in two. The frame's output
copy (frame_outputs.py) makes those zeros itself instead (`zeros_for`: as autograd would, fresh, one per output,
so nothing is shared), marked with the version they were made at; a backward graph's copy-in (`ZeroCopyIn`)
leaves them out where the buffer holds zeros from the step before and was not written since. The zeros' fill is
autograd's, kept; the copy goes.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from ... import _compat
from ..tensors import storage_ptr

__all__ = ["ZeroCopyIn", "Layout", "is_made_zeros", "layout_of", "zeros_for"]

Layout = Tuple[torch.device, torch.dtype, Tuple[int, ...]]
_MARK = "cgcompile_zeros_version"  # on a tensor zeros_for made: its version then (a write moves the version on)


def layout_of(t: torch.Tensor) -> Layout:
    """(device, dtype, size): what autograd's zeros for an output without a gradient have (contiguous, as
    autograd makes them, which is what aot's backward expects: other strides it would copy to that format)."""
    return t.device, t.dtype, tuple(t.shape)


def zeros_for(layout: Layout) -> torch.Tensor:
    """New zeros of `layout`, marked as made here."""
    device, dtype, size = layout
    with torch.no_grad():
        zeros = torch.zeros(size, dtype=dtype, device=device)
    setattr(zeros, _MARK, zeros._version)
    return zeros


def is_made_zeros(t: Any) -> bool:
    """Is `t` zeros that zeros_for made, unwritten since?"""
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, None) == t._version


class ZeroCopyIn:
    """For a backward graph: its copy of the copied-in arguments into their buffers, in one dispatch, leaving out
    the zeros (zeros_for) going into a buffer that holds zeros already: the last thing copied into it was such
    zeros, and the buffer was not written since (its version counter tells). Only buffers no output of the graph
    shares qualify: nothing but this copy writes them."""

    def __init__(self, buffers: Sequence[torch.Tensor], copied: Sequence[int], candidates: Sequence[int]):
        self.buffers, self.copied, self.candidates = buffers, list(copied), list(candidates)
        self.zeroed: Dict[int, int] = {}  # position -> the buffer's version when zeros were last copied into it

    @classmethod
    def of(cls, buffers: Sequence[Any], copied: Sequence[int], outputs: Sequence[Any]) -> Optional["ZeroCopyIn"]:
        """The copy for a graph with these static inputs, copied positions and static outputs; None where no
        buffer qualifies."""
        shared = {storage_ptr(t) for t in outputs if isinstance(t, torch.Tensor)}
        candidates = [i for i in copied if storage_ptr(buffers[i]) not in shared]
        return cls(buffers, copied, candidates) if candidates else None

    def __call__(self, args: Sequence[Any]) -> bool:
        """Copy `args` in, leaving such zeros out; False (nothing copied) where no argument is such zeros: the
        caller's plain copy of every argument serves then."""
        made = [i for i in self.candidates if is_made_zeros(args[i])]
        buffers, zeroed = self.buffers, self.zeroed
        if not made:
            zeroed.clear()
            return False
        pairs = [(buffers[i], args[i]) for i in self.copied
                 if not (i in made and zeroed.get(i) == buffers[i]._version)]
        if pairs:
            _compat.copy_all([b for b, _ in pairs], [a for _, a in pairs])
        self.zeroed = {i: buffers[i]._version for i in made}
        return True

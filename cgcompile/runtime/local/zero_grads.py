"""One zeros tensor per layout for the frame outputs that get no gradient, kept from step to step.

A Hugging Face model's training frame returns the logits and, with `use_cache`, each layer's key and value
beside the loss, and the backward seeds only the loss. Autograd then hands the partitions that made the others
a new tensor of zeros every step (a fill kernel each), and each partition's backward graph copies them into its
static buffers (a copy kernel each; beside the loss's fp32 gradient, bf16 zeros split CUDA's multi-tensor copy
in two). The frame's output copy (frame_outputs.py) hands such an output the same zeros tensor every step
instead, and a backward graph does not copy it again into a buffer that already holds it (GraphInstance): no
kernel for it at all once the graph replays.

The zeros are only read: a backward that runs eagerly gets fresh zeros in their place (`private`), so no tensor
a caller could keep or write (a gradient handed to AccumulateGrad) shares their memory, and a zeros tensor whose
version counter moved anyway is never handed out again.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

__all__ = ["ZeroGrads", "Layout", "layout_of"]

Layout = Tuple[torch.device, torch.dtype, Tuple[int, ...]]


def layout_of(t: torch.Tensor) -> Layout:
    """(device, dtype, size): what autograd's zeros for an output without a gradient have (contiguous, as
    autograd makes them, which is what aot's backward expects: other strides it would copy to that format)."""
    return t.device, t.dtype, tuple(t.shape)


class ZeroGrads:
    """The zeros tensors handed out as gradients, one per layout, with the version each had when made."""

    def __init__(self) -> None:
        self._made: Dict[Layout, Tuple[torch.Tensor, int]] = {}

    def like(self, layout: Layout) -> torch.Tensor:
        """The zeros of this layout: the same tensor as last time unless something wrote it."""
        held = self._made.get(layout)
        if held is not None and held[0]._version == held[1]:
            return held[0]
        device, dtype, size = layout
        with torch.no_grad():
            zeros = torch.zeros(size, dtype=dtype, device=device)
        self._made[layout] = (zeros, zeros._version)
        return zeros

    def issued(self, t: Any) -> bool:
        """Is `t` one of the zeros handed out, unwritten since?"""
        if not isinstance(t, torch.Tensor) or not self._made:
            return False
        held = self._made.get(layout_of(t))
        return held is not None and held[0] is t and t._version == held[1]

    def private(self, args: Sequence[Any]) -> List[Any]:
        """`args` with each zeros tensor handed out replaced by fresh zeros (for a backward run eagerly)."""
        if not self._made:
            return list(args)
        return [torch.zeros_like(a) if self.issued(a) else a for a in args]

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

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ... import _compat
from ..tensors import storage_ptr

__all__ = ["ZeroCopyIn", "ZeroGrads", "Layout", "layout_of"]

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


class ZeroCopyIn:
    """A backward graph's copy of its copied-in arguments into their buffers, in one dispatch, leaving out the
    shared zeros a buffer holds already: the same tensor as last copied, and neither it nor the buffer written
    since (version counters tell). Only buffers no output of the graph shares qualify: nothing but this copy
    writes them."""

    def __init__(self, zeros: ZeroGrads, buffers: Sequence[torch.Tensor], copied: Sequence[int],
                 candidates: Sequence[int]):
        self.zeros, self.buffers, self.copied, self.candidates = zeros, buffers, list(copied), list(candidates)
        self.held: Dict[int, Tuple[torch.Tensor, int, int]] = {}  # position -> (zeros, their version, buffer's)

    @classmethod
    def of(cls, zeros: Optional[ZeroGrads], buffers: Sequence[Any], copied: Sequence[int],
           outputs: Sequence[Any]) -> Optional["ZeroCopyIn"]:
        """The copy for a graph with these static inputs, copied positions and static outputs; None without
        `zeros` (not a backward graph) or a buffer that qualifies."""
        if zeros is None:
            return None
        shared = {storage_ptr(t) for t in outputs if isinstance(t, torch.Tensor)}
        candidates = [i for i in copied if storage_ptr(buffers[i]) not in shared]
        return cls(zeros, buffers, copied, candidates) if candidates else None

    def __call__(self, args: Sequence[Any]) -> None:
        buffers, held = self.buffers, self.held
        pairs = [(buffers[i], args[i]) for i in self.copied
                 if not (i in held and held[i][0] is args[i] and held[i][1] == args[i]._version
                         and held[i][2] == buffers[i]._version)]
        if pairs:
            _compat.copy_all([b for b, _ in pairs], [a for _, a in pairs])
        issued = self.zeros.issued
        for i in self.candidates:
            if issued(args[i]):
                held[i] = (args[i], args[i]._version, buffers[i]._version)
            else:
                held.pop(i, None)

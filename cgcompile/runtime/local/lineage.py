"""Recompiles of one frame: a static frame that a recompile with dynamic sizes leaves without calls.

Under Dynamo's automatic dynamic shapes, a frame first compiles for the sizes it meets (static), and when a size
changes the same code compiles again with that size symbolic. Dynamo tries the newest entry first, and the dynamic
one accepts the sizes the static one was made for, so the static frame is never called again. Each frame has a
runtime of its own and the graph bank releases a partition's graphs only at that partition's own calls, so without
this the static frame's graphs (a forward and a backward per partition, with their memory) would stay alive for
the whole run.

`supersedes(new, old)` tells, from the two frames' lineages alone, whether `new` is such a recompile of `old`: the
same code object (Dynamo's frame id), compiled later, in the same grad mode, with the same tensor inputs (dtypes,
ranks, every size the new frame keeps concrete equal to the old one's, and no size of 0 or 1 where the new one is
symbolic: Dynamo specializes those), `new` with symbolic sizes and `old` without.
A frame compiled for another grad mode (an eval loop under no_grad) or for other parameter shapes is never
superseded. The runtime (model_runtime.py) acts on it with evidence: `Supersession` notes each superseded frame's
call count when the new frame is made, and the old frame's graphs are released at the end of the new frame's
first capture wave only if the old one made no call in between. A frame released wrongly captures again at its
next call, as after cgcompile.release(): a capture's cost, never a wrong result.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ... import _compat

__all__ = ["FrameLineage", "Supersession", "lineage_of", "supersedes"]

# per tensor input of a frame: its dtype and sizes, None where the size is symbolic
TensorSignature = Tuple[torch.dtype, Tuple[Optional[int], ...]]


@dataclasses.dataclass(frozen=True)
class FrameLineage:
    """Which code object a compiled frame comes from, and the inputs it was compiled for."""

    frame_id: Optional[int]  # Dynamo's id of the code object (None outside a Dynamo compile)
    compile_index: int  # which compile of that code it is (0 first)
    training: bool  # the grad mode it was entered in
    dynamic: bool  # compiled with symbolic sizes
    tensors: Tuple[TensorSignature, ...]


def lineage_of(graph_inputs: Sequence[Any], training: bool) -> FrameLineage:
    """The lineage of the frame Dynamo is compiling now, from its graph's placeholder values (the FakeTensors and
    SymInts of each placeholder's meta["example_value"])."""
    found = _compat.compile_id()
    tensors = tuple((v.dtype, tuple(None if isinstance(d, torch.SymInt) else int(d) for d in v.shape))
                    for v in graph_inputs if isinstance(v, torch.Tensor))
    dynamic = any(isinstance(v, torch.SymInt) for v in graph_inputs) or any(
        d is None for _, sizes in tensors for d in sizes)
    return FrameLineage(None if found is None else found[0], 0 if found is None else found[1], training, dynamic,
                        tensors)


def supersedes(new: FrameLineage, old: FrameLineage) -> bool:
    """Is `new` a recompile of `old` with dynamic sizes that accepts the sizes `old` was compiled for?"""
    if new.frame_id is None or new.frame_id != old.frame_id or new.compile_index <= old.compile_index:
        return False
    if new.training != old.training or not new.dynamic or old.dynamic or len(new.tensors) != len(old.tensors):
        return False
    # a symbolic size never stands for 0 or 1: Dynamo specializes those, so a frame made for them stays in use
    return all(n_dtype == o_dtype and len(n_sizes) == len(o_sizes)
               and all(n == o or (n is None and o is not None and o > 1) for n, o in zip(n_sizes, o_sizes))
               for (n_dtype, n_sizes), (o_dtype, o_sizes) in zip(new.tensors, old.tensors))


class Supersession:
    """The frames a new frame supersedes, each with its call count when the new frame was made; `due()` gives
    those that made no call since (once: the new frame's first capture wave ends only once)."""

    def __init__(self, lineage: Optional[FrameLineage], runtimes: List[Any], same_options: Callable[[Any], bool],
                 calls_of: Callable[[Any], int]):
        self._calls_of = calls_of
        self._watched: List[Tuple[weakref.ref, int]] = [] if lineage is None else [
            (weakref.ref(rt), calls_of(rt)) for rt in runtimes
            if rt.lineage is not None and same_options(rt) and supersedes(lineage, rt.lineage)]

    def due(self) -> List[Any]:
        """The superseded frames' runtimes alive and without a call since the new frame was made; forgets all."""
        watched, self._watched = self._watched, []
        return [rt for ref, calls in watched for rt in [ref()] if rt is not None and self._calls_of(rt) == calls]

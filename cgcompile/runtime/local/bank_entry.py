"""One aot_autograd compilation of a partition (one graph-bank key): a `BankEntry` and the graph families aot
creates through our compilers (family.py: forward and inference; backward_family.py: backward).

aot_autograd splits the partition into functional aten forward and backward graphs; its runtime wrappers keep
doing input mutation copy-back and output aliasing, while our compilers wrap each graph in a graph family that
warms up, captures and replays it through the driver.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch.fx as fx

from ... import _compat
from ...passes.collectives import collective_counts
from ...passes.mutation import mutated_inputs
from ...rewrites.input_writes import write_inputs_in_place
from ...rewrites.intermediate_writes import write_intermediates_in_place
from ..drivers.thread_state import preserved_global_state
from ..tensors import at_positions
from .backward_family import BackwardFamily
from .family import GraphFamily
from .traced_strides import keep_traced_strides

__all__ = ["BankEntry"]


class BankEntry:
    """One aot_autograd compilation of a partition (one graph-bank key) and its forward/backward/inference
    graph families (which aot creates through our compilers)."""

    def __init__(self, part: Any, args: Sequence[Any]):
        self.part = part
        self.forward: Optional[GraphFamily] = None
        self.backward: Optional[GraphFamily] = None
        self.inference: Optional[GraphFamily] = None
        self.bumps: Optional[tuple] = None  # inference graph aot's wrapper only calls: the positions it bumps
        self.bumped: Optional[Callable[[Sequence[Any]], tuple]] = None  # those arguments of a call
        self.batch = part.arenas.batch_of(args)  # capture_sizes: the (padded) batch of this signature
        with preserved_global_state():  # tracing runs the partition's grad-mode/vmap switches for real
            self.fn = _compat.aot_compile(part.traced, args, self._family,
                                          inductor=part.inductor)

    def _family(self, kind: str, run: Callable[[list], Any], gm: fx.GraphModule,
                direct: Optional[tuple]) -> Callable[[list], Any]:
        """Called by aot for each graph it compiles: the GraphFamily aot runs instead of it."""
        if kind == "inference":
            self.bumps = direct
            if direct:  # the arguments whose versions a call bumps, in one C call
                self.bumped = at_positions(direct)
        inductor = self.part.inductor  # it reinplaces writes, lays out its buffers
        if not inductor:
            write_inputs_in_place(gm)  # `run` calls gm: a buffer's write in place, not three copies of the buffer
            write_intermediates_in_place(gm)  # and an intermediate's: one kernel, not a copy and the write
        mutated = mutated_inputs(gm)
        if not inductor:
            run = keep_traced_strides(gm, run, f"{self.part.name} {kind}")
        elif kind == "backward":  # its kernels may write the saved tensors donated to it: undone after a capture run
            mutated |= _compat.donated_inputs()
        family = (BackwardFamily if kind == "backward" else GraphFamily)(self, kind, run, mutated,
                                                                         collective_counts(gm))
        setattr(self, kind, family)
        return family

    def run_direct(self, args: Sequence[Any]) -> List[Any]:
        """An inference call without aot's runtime wrapper, for an inference graph it would only call (`bumps` set):
        its per-argument work, redone on every call, skipped. The graph, then the version bumps the wrapper makes
        for the inputs the graph writes."""
        out = self.inference(list(args))
        if self.bumped is not None:
            _compat.increment_versions(self.bumped(args))
        return out

    def discard(self) -> None:
        for family in (self.forward, self.inference):
            if family is not None:
                family.discard()

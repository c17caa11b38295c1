"""The backward graphs of one partition's input signature: each belongs to one forward instance (captured at its
first backward, replayed with it), found from the saved tensors autograd hands the backward (family.py has the
forward and inference families this one extends).

A backward graph replays where the pool rule (runtime/memory/registry.py) allows. An instance first needed a step
after the others (the last micro-batch of a schedule with several in flight: a step's first call is a warmup run)
lies after their backward graphs in the pool, and is held whenever they replay; and a backward graph reading
another one's output in place misses its addresses once that one is captured again. Either way the backward graph
is captured again after it, once, rather than run eagerly at every step.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from .family import EagerHandout, GraphFamily, forward_call_of
from .instance import GraphInstance

__all__ = ["BackwardFamily"]

log = logging.getLogger("cgcompile")


def _lender_moved(bw: GraphInstance, args: Sequence[Any], memory: Any) -> bool:
    """Does `bw` miss its addresses because a graph it reads from in place was captured again (moved, below)? Then
    an argument lies in the memory of a live graph captured after `bw`, where later calls will find it too; an
    argument from an eager run (a lesson's) lies in no graph's memory."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            lender = memory.owner(arg)
            if isinstance(lender, GraphInstance) and (lender.pool_position or 0) > (bw.pool_position or 0):
                return True
    return False


# Why a backward graph is released and captured again: a forward instance captured after it (a micro-batch whose
# instance was first needed a step later) is held whenever it replays (the pool rule, memory/registry.py), or the
# graph it reads from in place was captured again so
_MOVED_IN_POOL = ("captured before a graph held whenever it replays, as in a schedule with several micro-batches in "
                  "flight, or before the graph it reads from was: captured again after it")


class BackwardFamily(GraphFamily):
    """The backward graphs of one bank entry: each belongs to one forward instance (captured at its first
    backward, replayed with it), found from the saved tensors autograd hands the backward."""

    said_unpaired = False  # logged once that a backward had no known forward among several awaiting

    def __call__(self, args: list) -> Any:
        with self.part.runtime.calls:  # one thread's call of the frame's graphs at a time (serialized.py)
            return self._replay_or_run(args)

    def _replay_or_run(self, args: list) -> Any:
        part = self.part
        if part.broken is not None or not part.driver.captures:
            return self.run(args)
        forward = self.entry.forward
        source = forward_call_of(args, forward)
        if isinstance(source, EagerHandout):
            source.backward_ran()
            return self._run_warming(source.param_set, args)
        instance = source if source is not None else forward.owner_of(args) if forward is not None else None
        handout = forward.pending_eager_run() if instance is None and forward is not None else None
        if handout is not None:
            handout.backward_ran()
            return self._run_warming(handout.param_set, args)
        if instance is None and forward is not None:
            instance = self._forward_of_replaced(forward)
        if instance is None or not instance.alive:
            return self.run_eagerly(args)  # its forward ran eagerly (cap, fallback) or was released
        instance.backward_ran()
        forward.note_saved(instance, args)
        runtime, moved = self.part.runtime, None
        bw = instance.bw
        if bw is not None:
            if bw.addresses_match(args):  # a graph captured after it held (the pool rule): moved once
                blocker = bw.replay_blocker(runtime.memory.pool_blocker)
                movable = blocker is not None and blocker is not bw and not bw.moved_in_pool
            else:  # the graph it reads from in place was moved
                blocker, movable = bw, _lender_moved(bw, args, runtime.memory)
            if blocker is not None:
                if not movable:  # e.g. a second backward through one forward (retain_graph)
                    return self.run(args)
                moved = bw  # captured again after the graph that held it, or after its lender, once
                self.part.releaser.release([moved], _MOVED_IN_POOL)
                if instance.bw is not None:
                    return self.run(args)
        if instance.bw is None:
            try:
                instance.attach_backward(self._capture(instance.param_set, args, instance.param_storages, instance))
            except Exception as exc:
                self.part.fail(f"capturing its backward graph failed: {type(exc).__name__}: {exc}")
                return self.run(args)
            if moved is not None:
                instance.bw.replaces_in_pool(moved)
            runtime.captured_within_budget(self.part)
            if self.part.broken is not None:  # past the budget: its graphs are released, this backward runs eagerly
                return self.run(args)
        bw = instance.bw
        bw.note_grads(self._grads_cleared(instance))
        # An arena's memory is shared with other sizes: hand out aliases, whose lives the arena can see (autograd
        # may hold a returned grad in an input buffer until another size's backward has run), until a grad kept as
        # .grad into the next forward shows the loop keeps them (GraphFamily._lesson): copied from then on.
        out = self.part.benefit.replay(bw, args, bw.hands_out_aliases, self.copied_outputs)
        runtime.mark_in_flight(bw)
        return out

    def _forward_of_replaced(self, forward: GraphFamily) -> Optional[GraphInstance]:
        """The forward instance of a backward whose saved tensors name no forward call and lie in no graph's memory:
        a saved_tensors_hooks pack and unpack replaced them (activation offloading, `save_on_cpu` on a GPU; a
        compressing hook). It is the one live instance whose replay still awaits its backward, when exactly one
        does and the graph serves one parameter set (one layer: a frame shared by several layers would leave the
        layer unknown); the backward graph captured for it copies those tensors in (they lie in no graph's memory),
        so nothing pairs it with that instance's memory. Else None: the backward runs eagerly, and with several
        replays awaiting (forwards in flight) the log says why, once."""
        pending = [graph for graph in forward.all_instances() if graph.alive and graph.pending_backward]
        if len(pending) == 1 and len(forward.instances) == 1:
            return pending[0]
        if len(pending) > 1 and not self.said_unpaired:
            self.said_unpaired = True
            log.info("cgcompile: %s runs a backward eagerly: the tensors autograd saved for it are not its forward "
                     "graph's outputs (a saved_tensors_hooks pack may have replaced them, e.g. activation offloading) "
                     "and %d forward replays await their backward, so none is known to be its forward",
                     self.part.name, len(pending))
        return None

    @staticmethod
    def _grads_cleared(instance: GraphInstance) -> bool:
        """Are the grads of the parameters this instance reads unset, as after zero_grad(set_to_none=True)?
        Checked before the backward replays, i.e. before AccumulateGrad runs for them."""
        params = [ref() for ref in instance.param_refs.values()]
        return all(p is None or p.grad is None for p in params)

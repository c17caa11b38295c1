"""Counting the ops a compiled frame dispatches outside the graphs it replays, and inside them (emulate driver):
`FrameOps` counts while it is the counter at the end of `counters`, which `counting_backend`'s frames enter around
each call (inside Dynamo's frame, so the mode changes no guard), and `replays_flagged` tells the two apart."""

import contextlib

from cgcompile._compat import TorchDispatchMode
from cgcompile.backend import cudagraph_modules
from cgcompile.runtime.drivers.emulate import EmulatedGraph


class FrameOps(TorchDispatchMode):
    inside = False  # set while an emulated graph replays (replays_flagged)

    def __init__(self):
        super().__init__()
        self.ops, self.graph_ops = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ops = self.graph_ops if FrameOps.inside else self.ops
        ops[str(func)] = ops.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def replays_flagged():
    replay = EmulatedGraph.replay

    def flagged(self):
        FrameOps.inside = True
        try:
            return replay(self)
        finally:
            FrameOps.inside = False

    EmulatedGraph.replay = flagged
    try:
        yield
    finally:
        EmulatedGraph.replay = replay


def counting_backend(options: dict, counters: list):
    """A backend for torch.compile: cudagraph_modules with `options`, each frame call counted by counters[-1]."""
    def backend(gm, example_inputs):
        frame = cudagraph_modules(gm, example_inputs, options=options)

        def run(*args):
            if not counters:
                return frame(*args)
            with counters[-1]:
                return frame(*args)
        return run
    return backend

"""Count what a step still runs op by op on the host: the CPU proxy for launch overhead.

On a GPU every op dispatched outside a CUDA graph is a kernel launch (or more) paid on the host, and every
data-dependent read (nonzero's size, .item()) is a sync. The emulate driver replays a graph by running its ops
inside a profiler range (driver.REPLAY_RANGE); they stand for one graph launch and are counted apart.
torch.profiler is used rather than a dispatch mode because Dynamo does not run compiled code under an active
dispatch mode.
"""

from __future__ import annotations

import torch

from .driver import REPLAY_RANGE

__all__ = ["HostOpCounter", "SYNC_OPS"]

# aten ops that read device data on the host (size or value)
SYNC_OPS = frozenset({"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::unique",
                      "aten::_unique2", "aten::unique_consecutive", "aten::bincount", "aten::equal",
                      "aten::is_nonzero", "aten::repeat_interleave", "aten::item"})

# our own ops: not kernels themselves; the aten ops they run are counted (and their host read is a sync)
CONTAINER_OPS = frozenset({"cgcompile::nonzero_bucketed"})


# view, metadata and allocation ops: no kernel runs, so they cost no launch (the runtime hands outputs out as
# detach() aliases)
VIEW_OPS = frozenset("aten::" + name for name in (
    "new_empty", "new_empty_strided", "sym_size", "detach", "alias", "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "slice", "select",
    "unsqueeze", "squeeze", "transpose", "permute", "expand", "t", "unbind", "split", "split_with_sizes", "chunk",
    "narrow", "lift_fresh", "empty", "empty_strided", "empty_like", "resolve_conj", "resolve_neg", "view_as",
    "_to_copy_view", "flatten", "unflatten", "numpy_T", "contiguous"))


class HostOpCounter:
    """`with HostOpCounter() as c: step()` -> c.ops (top-level aten ops that run a kernel, outside graph
    replays; views and metadata ops are free and not counted), c.syncs
    (those among them that read device data on the host), c.replays (graph replays), c.flops (the profiler's
    FLOP estimate of the matmuls, inside replays or not: what padding adds to the compute)."""

    def __enter__(self) -> "HostOpCounter":
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        self.ops = self.syncs = self.replays = self.flops = 0
        for event in self._profile.events():
            if event.flops and not _has_flops_parent(event):
                self.flops += event.flops
            if event.name == REPLAY_RANGE:
                self.replays += 1
                continue
            if not _is_op(event.name) or event.name in VIEW_OPS or event.name in CONTAINER_OPS \
                    or _inside(event, REPLAY_RANGE) or _has_op_parent(event):
                continue
            self.ops += 1
            self.syncs += event.name in SYNC_OPS


def _is_op(name: str) -> bool:
    return name.startswith("aten::")


def _inside(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def _has_op_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_op(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def _has_flops_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.flops:
            return True
        parent = parent.cpu_parent
    return False

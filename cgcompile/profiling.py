"""Count what a step still runs op by op on the host: the CPU proxy for launch overhead (a benchmark and
test tool; nothing in the backend uses it).

On a GPU every op dispatched outside a CUDA graph is a kernel launch (or more) paid on the host, and every
data-dependent read (nonzero's size, .item()) is a sync. The emulate driver replays a graph by running its ops
inside a profiler range (emulate_driver.REPLAY_RANGE); they stand for one graph launch and are counted apart.
torch.profiler is used rather than a dispatch mode because Dynamo does not run compiled code under an active
dispatch mode.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .runtime.drivers.emulate import REPLAY_RANGE

__all__ = ["HostOpCounter", "SYNC_OPS", "count_events"]

# aten ops that read device data on the host (size or value)
SYNC_OPS = frozenset({"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::unique",
                      "aten::_unique2", "aten::unique_consecutive", "aten::bincount", "aten::equal",
                      "aten::is_nonzero", "aten::repeat_interleave", "aten::item"})


# view, metadata and allocation ops: no kernel runs, so they cost no launch (the runtime hands outputs out as
# detach() aliases)
NO_KERNEL_OPS = frozenset("aten::" + name for name in (
    "new_empty", "new_empty_strided", "sym_size", "detach", "alias", "view", "_unsafe_view", "reshape",
    "_reshape_alias", "as_strided", "slice", "select", "unsqueeze", "squeeze", "transpose", "permute", "expand", "t", "unbind", "split", "split_with_sizes", "chunk",
    "narrow", "lift_fresh", "empty", "empty_strided", "empty_like", "resolve_conj", "resolve_neg", "view_as",
    "_to_copy_view", "flatten", "unflatten", "numpy_T", "contiguous"))


class HostOpCounter:
    """`with HostOpCounter() as c: step()` -> c.ops (top-level aten ops that run a kernel, outside graph
    replays; views and metadata ops are free and not counted), c.syncs (those among them that read device
    data on the host, themselves or through an op they call), c.replays (graph replays), c.flops (the
    profiler's FLOP estimate of the matmuls, inside replays or not: what padding adds to the compute)."""

    def __enter__(self) -> "HostOpCounter":
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        events = self._profile.events()
        self.ops, self.syncs, self.replays = count_events(events)
        self.flops = sum(e.flops for e in events if e.flops and not _has_flops_parent(e))


def count_events(events) -> Tuple[int, int, int]:
    """(ops, syncs, replays) as HostOpCounter defines them, from any torch.profiler event list (so a caller
    that profiles for other reasons, e.g. with CUDA activity, gets the same counts from the same pass).
    A top-level op is a sync when it or an op it calls is in SYNC_OPS: `torch.where(mask)` reaches
    aten::nonzero through aten::nonzero_numpy, `.item()` reaches _local_scalar_dense through aten::item.
    Our own ops (cgcompile::nonzero_bucketed) are not kernels: the aten ops they call count as top-level ones."""
    replays = 0
    tops, sync_tops = set(), set()  # ids of top-level ops that run a kernel; of those that reach a sync op
    for event in events:
        if event.name == REPLAY_RANGE:
            replays += 1
            continue
        if not _is_op(event.name) or _inside(event, REPLAY_RANGE):
            continue
        root = _op_root(event)
        if root is event and event.name not in NO_KERNEL_OPS:
            tops.add(id(event))
        if event.name in SYNC_OPS:
            sync_tops.add(id(root))
    return len(tops), len(sync_tops & tops), replays


def _is_op(name: str) -> bool:
    return name.startswith("aten::")


def _ancestors(event):
    """The events `event` runs under, innermost first."""
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _inside(event, name: str) -> bool:
    return any(parent.name == name for parent in _ancestors(event))


def _op_root(event):
    """The outermost op event that `event` runs under (itself when no op called it)."""
    root = event
    for parent in _ancestors(event):
        if _is_op(parent.name):
            root = parent
    return root


def _has_flops_parent(event) -> bool:
    return any(parent.flops for parent in _ancestors(event))

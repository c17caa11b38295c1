"""FSDP2's private parameter state (torch.distributed.fsdp._fully_shard): which parameters are unsharded, and keeping
their storage across a reshard. Re-exported by cgcompile._compat."""

from __future__ import annotations

import sys
from typing import Any, List, NamedTuple

import torch

__all__ = ["FsdpParam", "fsdp2_keep_unsharded", "fsdp2_params", "fsdp2_restore_free"]

# --- FSDP2 (torch.distributed.fsdp._fully_shard, private modules) ---------------------------------------------
# Checked on 2.13 (installed, run by tests/test_fsdp.py) and in the pytorch main source; 2.11 not run (both
# spellings of the param groups are handled). Used: FSDPState per fully_shard call, found through
# torch.distributed._composable_state._module_state_mapping (module -> weakref to its state); its param groups
# (`_fsdp_param_groups`, a list since per-parameter meshes; `_fsdp_param_group`, one or None, before);
# FSDPParamGroup._reshard_after_forward; FSDPParam._unsharded_param (built at the first all-gather, then the same
# object), `sharded_param`, `_param_fqn`, `sharded_state`, `all_gather_outputs`, `_unsharded_inner_tensors` and
# `free_unsharded_param()`, which resizes their storage to 0 at every reshard (alloc_storage sizes it again
# before the next all-gather copy-out, at a new address, and skips a storage that already has the full size).
_FSDP_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"


class FsdpParam(NamedTuple):
    """One FSDP2-managed parameter whose unsharded form exists (it has been all-gathered once)."""

    unsharded: torch.nn.Parameter  # what the wrapped module reads while unsharded (the same object each step)
    sharded: torch.nn.Parameter  # the DTensor parameter model.parameters() returns while sharded
    handle: Any  # FSDP2's FSDPParam
    fqn: str
    resharded_after_forward: bool  # fully_shard(reshard_after_forward=True) for its group (not the root's)
    nbytes: int  # its unsharded storage (all-gather outputs, padded)


def fsdp2_params() -> List[FsdpParam]:
    """Every FSDP2 parameter alive in this process with an unsharded form; [] at once when FSDP2's state module
    was never imported (no fully_shard call), so ordinary models pay one dict lookup."""
    state_module = sys.modules.get(_FSDP_STATE_MODULE)
    if state_module is None:
        return []
    from torch.distributed._composable_state import _module_state_mapping

    found: List[FsdpParam] = []
    states = {id(s): s for s in (ref() for ref in list(_module_state_mapping.values()))
              if isinstance(s, state_module.FSDPState)}
    for state in states.values():
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            resharded = bool(group._reshard_after_forward)
            for handle in group.fsdp_params:
                unsharded = getattr(handle, "_unsharded_param", None)
                if unsharded is None:
                    continue
                outputs = list(handle.all_gather_outputs) + list(getattr(handle, "_unsharded_inner_tensors", ()))
                nbytes = sum(t.numel() * t.element_size() for t in outputs)
                found.append(FsdpParam(unsharded, handle.sharded_param, handle, str(handle._param_fqn), resharded,
                                       nbytes))
    return found


def _keep_storage() -> None:
    """Stands in for FSDPParam.free_unsharded_param while cgcompile keeps the unsharded storage."""


def fsdp2_keep_unsharded(handle: Any) -> None:
    """Make FSDP2 keep this parameter's unsharded storage at reshard: an instance attribute shadows
    FSDPParam.free_unsharded_param (the all-gathers go on, into the same storage)."""
    handle.free_unsharded_param = _keep_storage


def fsdp2_restore_free(handle: Any) -> None:
    """Undo fsdp2_keep_unsharded, and free the storage now if FSDP2 would have (the parameter is resharded)."""
    if vars(handle).get("free_unsharded_param") is not _keep_storage:
        return
    del handle.free_unsharded_param
    if getattr(handle.sharded_state, "name", None) != "UNSHARDED":
        handle.free_unsharded_param()

"""Would running this op make the host wait for the device? The rules are cgcompile/sync_rules.py's, the ones
the plan applies too; this is their message for the drivers' capture guard (runtime/drivers/capture_guard.py)
and capture_step's pre-check (runtime/frame/whole_step.py).

`on_cuda` says what "the device" is: False for the emulate driver, which models the CPU as the device (every
tensor is device memory, Python data entering a tensor is a host-to-device copy); True for a real CUDA capture,
where only CUDA tensors are device memory.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ...sync_rules import copy_detail, op_sync_rule

__all__ = ["host_sync_reason"]


def host_sync_reason(func: Any, args: Sequence[Any], kwargs: dict, on_cuda: bool) -> Optional[str]:
    """Why running `func` would make the host wait for the device, or None."""
    rule = op_sync_rule(func, args, kwargs, on_cuda)
    if rule is None:
        return None
    detail = copy_detail(func, args, kwargs) if rule.name == "host_device_copy" else rule.detail
    return f"{func} {detail}"

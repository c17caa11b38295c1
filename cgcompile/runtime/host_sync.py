"""Would running this op make the host wait for the device? A pure check on an op and its arguments, used by
the drivers' capture guard (driver.py) and by capture_step's pre-check (whole_step.py)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = ["host_sync_reason"]

_INDEX_PUT = (torch.ops.aten.index_put, torch.ops.aten.index_put_, torch.ops.aten._index_put_impl_)


def _has_mask(indices: Any) -> bool:
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def host_sync_reason(func: Any, args: Sequence[Any], kwargs: dict, on_cuda: bool) -> Optional[str]:
    """Why running `func` would make the host wait for the device, or None. Cheap checks on op tags."""
    tags = getattr(func, "tags", ())
    name = str(func)
    if torch.Tag.data_dependent_output in tags:
        return f"{name} reads a device value on the host"
    if torch.Tag.dynamic_output_shape in tags:
        packet = getattr(func, "overloadpacket", None)
        if packet is torch.ops.aten.index:  # only boolean-mask indexing has a data-dependent shape
            if not _has_mask(args[1] if len(args) > 1 else kwargs.get("indices", ())):
                return None
        elif packet is torch.ops.aten.repeat_interleave:
            if kwargs.get("output_size") is not None:
                return None
        elif packet is torch.ops.aten.one_hot:
            num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
            if num_classes != -1:
                return None
        return f"{name} has a data-dependent output shape (its size is read on the host)"
    if getattr(func, "overloadpacket", None) in _INDEX_PUT and _has_mask(args[1] if len(args) > 1 else ()):
        return f"{name} with a boolean mask finds the masked positions on the host"
    if on_cuda and func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
        src = args[1] if func is torch.ops.aten.copy_.default else args[0]
        dst_cpu = (args[0].device.type == "cpu" if func is torch.ops.aten.copy_.default
                   else torch.device(kwargs.get("device") or src.device).type == "cpu")
        if isinstance(src, torch.Tensor) and src.device.type == "cuda" and dst_cpu:
            return f"{name} copies a CUDA tensor to the CPU"
    return None

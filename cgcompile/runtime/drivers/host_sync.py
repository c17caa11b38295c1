"""Would running this op make the host wait for the device? A pure check on an op and its arguments, used by
the drivers' capture guard (runtime/drivers/capture_guard.py) and by capture_step's pre-check (runtime/frame/whole_step.py).

`on_cuda` says what "the device" is: False for the emulate driver, which models the CPU as the device (every
tensor is device memory, Python data entering a tensor is a host-to-device copy); True for a real CUDA capture,
where only CUDA tensors are device memory.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = ["host_sync_reason"]

_INDEX_PUT = (torch.ops.aten.index_put, torch.ops.aten.index_put_, torch.ops.aten._index_put_impl_)
_LINALG_CHECK = torch.ops.aten._linalg_check_errors
_HISTC = torch.ops.aten.histc
_LIFT_FRESH = torch.ops.aten.lift_fresh


def _has_mask(indices: Any) -> bool:
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _arg(args: Sequence[Any], kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _is_cuda(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _copy_reason(func: Any, args: Sequence[Any], kwargs: dict) -> Optional[str]:
    """A copy between host and CUDA memory: to the host it waits for the device; to the device from pageable
    memory it waits too (and a non_blocking one from pinned memory would read the host buffer at every replay)."""
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        dst_device = dst.device
    elif func is torch.ops.aten._to_copy.default:
        src = args[0]
        dst_device = torch.device(kwargs.get("device") or src.device)
    else:
        return None
    if not isinstance(src, torch.Tensor):
        return None
    if src.device.type == "cuda" and dst_device.type == "cpu":
        return f"{func} copies a CUDA tensor to the CPU"
    if src.device.type == "cpu" and dst_device.type == "cuda":
        non_blocking = args[2] if func is torch.ops.aten.copy_.default and len(args) > 2 else kwargs.get(
            "non_blocking", False)
        if non_blocking and src.is_pinned():
            return None  # captured as a copy node that reads the pinned buffer at every replay
        return f"{func} copies pageable (or blocking) host memory to the GPU"
    return None


def host_sync_reason(func: Any, args: Sequence[Any], kwargs: dict, on_cuda: bool) -> Optional[str]:
    """Why running `func` would make the host wait for the device, or None. Cheap checks on op tags."""
    tags = getattr(func, "tags", ())
    name = str(func)
    packet = getattr(func, "overloadpacket", None)
    if torch.Tag.data_dependent_output in tags:
        return f"{name} reads a device value on the host"
    if torch.Tag.cudagraph_unsafe in tags:
        return f"{name} is tagged cudagraph_unsafe (it syncs or reads host memory)"
    if torch.Tag.dynamic_output_shape in tags:
        if packet is torch.ops.aten.index:  # only boolean-mask indexing has a data-dependent shape
            if not _has_mask(_arg(args, kwargs, 1, "indices", ())):
                return None
        elif packet is torch.ops.aten.repeat_interleave:
            if kwargs.get("output_size") is not None:
                return None
        elif packet is torch.ops.aten.one_hot:
            if _arg(args, kwargs, 1, "num_classes", -1) != -1:
                return None
        return f"{name} has a data-dependent output shape (its size is read on the host)"
    if packet in _INDEX_PUT and _has_mask(_arg(args, kwargs, 1, "indices", ())):
        return f"{name} with a boolean mask finds the masked positions on the host"
    if packet is _LINALG_CHECK:
        return f"{name} reads a linalg result's error codes on the host (pass check_errors=False / use *_ex)"
    if packet is _HISTC and _arg(args, kwargs, 2, "min", 0) == _arg(args, kwargs, 3, "max", 0):
        return f"{name} with min == max reads the input's range on the host (pass an explicit range)"
    if on_cuda:
        return _copy_reason(func, args, kwargs)
    if packet is _LIFT_FRESH:
        return (f"{name}: torch.tensor(...) of Python data; on a GPU its copy to the device syncs with the host "
                f"(create it once outside the captured code, or with torch.full / torch.zeros on the device)")
    return None

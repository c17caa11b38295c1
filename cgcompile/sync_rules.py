"""The one list of host-sync rules: which ops make the host wait for the device, so that they cannot be captured.

The plan-time pass (passes/sync_ops.py) and the runtime's capture guard (runtime/drivers/host_sync.py and
capture_guard.py) both read these tables; with two lists they disagreed, and the plan marked "capture" what the
guard then rejected (a boolean-mask `t[mask] = 0`). tests/test_sync_rules.py builds every rule's op in a tiny
module and checks the plan keeps it eager. Pure: an op and its argument values in (real tensors at run time, the
fake values Dynamo recorded at plan time), a rule out. It sits beside the plan, below the runtime, and imports
neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from .reasons import Reason

__all__ = ["DEVICE_SYNCS", "HOST_COPY_HINT", "OP_RULES", "SyncRule", "TENSOR_READS", "TensorRead", "copy_detail",
           "op_sync_rule"]


@dataclass(frozen=True)
class SyncRule:
    """One aten-level rule. `applies(func, args, kwargs, on_cuda)`; `func` is an overload (at run time) or an
    overload packet (at plan time, when the call's overload cannot be resolved). `reason` is the plan's
    category; `detail` follows the op's name in messages."""

    name: str
    reason: Reason
    detail: str
    hint: str
    applies: Callable[[Any, Sequence[Any], dict, bool], bool]


@dataclass(frozen=True)
class TensorRead:
    """A Python-level read of a tensor's value (it bypasses the dispatcher; the guard patches the method)."""

    what: str
    hint: str


def _arg(args: Sequence[Any], kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _has_mask(indices: Any) -> bool:
    """Whether an index list holds a boolean (or uint8) mask: its positions are found on the host."""
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _tags_of(func: Any) -> frozenset:
    """An overload's tags; for a packet, those of any overload (a call that could not be resolved)."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        try:
            return frozenset(t for name in func.overloads() for t in getattr(func, name).tags)
        except (AttributeError, RuntimeError):
            return frozenset()
    return frozenset(getattr(func, "tags", ()))


def _packet(func: Any) -> Any:
    return getattr(func, "overloadpacket", func)


def _static_dynamic_shape_form(func: Any, args: Sequence[Any], kwargs: dict) -> bool:
    """The forms of a dynamic-output-shape op whose size is known without reading data."""
    packet = _packet(func)
    if packet is torch.ops.aten.index:  # only boolean-mask indexing has a data-dependent shape
        return not _has_mask(_arg(args, kwargs, 1, "indices", ()))
    if packet is torch.ops.aten.repeat_interleave:
        return kwargs.get("output_size") is not None
    if packet is torch.ops.aten.one_hot:
        return _arg(args, kwargs, 1, "num_classes", -1) != -1
    return False


def _copy_between_host_and_device(func: Any, args: Sequence[Any], kwargs: dict) -> Optional[str]:
    """A copy between host and CUDA memory: to the host it waits for the device; to the device from pageable
    memory it waits too (and a non_blocking one from pinned memory would read the host buffer at every replay)."""
    if func is torch.ops.aten.copy_.default:
        src, dst_device = args[1], args[0].device
    elif func is torch.ops.aten._to_copy.default:
        src = args[0]
        dst_device = torch.device(kwargs.get("device") or src.device)
    else:
        return None
    if not isinstance(src, torch.Tensor):
        return None
    if src.device.type == "cuda" and dst_device.type == "cpu":
        return "copies a CUDA tensor to the CPU"
    if src.device.type == "cpu" and dst_device.type == "cuda":
        non_blocking = args[2] if func is torch.ops.aten.copy_.default and len(args) > 2 else kwargs.get(
            "non_blocking", False)
        if non_blocking and src.is_pinned():
            return None  # captured as a copy node that reads the pinned buffer at every replay
        return "copies pageable (or blocking) host memory to the GPU"
    return None


_INDEX_PUT = (torch.ops.aten.index_put, torch.ops.aten.index_put_, torch.ops.aten._index_put_impl_)
_KEEP_ON_DEVICE = "keep the value on the device as a 0-d tensor (e.g. torch.where instead of a Python if)"
HOST_COPY_HINT = "move the host copy out of the captured region, or keep the tensor on the device"

# Checked in order; the first that applies is the reason.
OP_RULES: Tuple[SyncRule, ...] = (
    SyncRule("data_dependent_output", Reason.HOST_SYNC, "reads a device value on the host",
             "compare on the device and keep the result a tensor",
             lambda f, a, k, cuda: torch.Tag.data_dependent_output in _tags_of(f)),
    SyncRule("cudagraph_unsafe", Reason.CUDAGRAPH_UNSAFE, "is tagged cudagraph_unsafe (it syncs or reads host memory)",
             "the op's author marked it unsafe to capture; it runs eagerly",
             lambda f, a, k, cuda: torch.Tag.cudagraph_unsafe in _tags_of(f)),
    SyncRule("dynamic_output_shape", Reason.DYNAMIC_SHAPE,
             "has a data-dependent output shape (its size is read on the host)",
             "use a static-shape form (torch.nonzero_static, output_size=, or pad each group to a fixed capacity)",
             lambda f, a, k, cuda: torch.Tag.dynamic_output_shape in _tags_of(f)
             and not _static_dynamic_shape_form(f, a, k)),
    SyncRule("bool_mask_index_put", Reason.HOST_SYNC, "with a boolean mask finds the masked positions on the host",
             "write through the mask on the device: t.masked_fill_(mask, value) or torch.where(mask, value, t)",
             lambda f, a, k, cuda: _packet(f) in _INDEX_PUT and _has_mask(_arg(a, k, 1, "indices", ()))),
    SyncRule("linalg_check_errors", Reason.HOST_SYNC,
             "reads a linalg result's error codes on the host (pass check_errors=False / use *_ex)",
             "call the *_ex form (torch.linalg.inv_ex, ...) and check its info tensor outside the captured region",
             lambda f, a, k, cuda: _packet(f) is torch.ops.aten._linalg_check_errors),
    SyncRule("histc_without_range", Reason.HOST_SYNC,
             "with min == max reads the input's range on the host (pass an explicit range)",
             "pass min= and max= explicitly",
             lambda f, a, k, cuda: _packet(f) is torch.ops.aten.histc
             and _arg(a, k, 2, "min", 0) == _arg(a, k, 3, "max", 0)),
    SyncRule("host_device_copy", Reason.HOST_SYNC, "copies between host memory and the GPU", HOST_COPY_HINT,
             lambda f, a, k, cuda: cuda and _copy_between_host_and_device(f, a, k) is not None),
    SyncRule("tensor_from_python_data", Reason.HOST_SYNC,
             "makes a tensor of Python data (torch.tensor(...)); on a GPU its copy to the device syncs with the host",
             "create it once outside the captured code, or with torch.full / torch.zeros on the device",
             lambda f, a, k, cuda: not cuda and _packet(f) is torch.ops.aten.lift_fresh),
)

# Python-level reads of a tensor's value: Tensor method -> what it is, the fix.
TENSOR_READS = {
    "item": TensorRead("Tensor.item()", _KEEP_ON_DEVICE),
    "tolist": TensorRead("Tensor.tolist()", "use fixed split sizes (pad each group to a capacity) so no host copy "
                                            "is needed"),
    "cpu": TensorRead("Tensor.cpu()", HOST_COPY_HINT),
    "numpy": TensorRead("Tensor.numpy()", "move the host copy out of the captured region"),
    "__bool__": TensorRead("bool(tensor)", "avoid Python control flow on tensor values; use torch.where"),
    "__int__": TensorRead("int(tensor)", "keep the value on the device as a tensor"),
    "__float__": TensorRead("float(tensor)", "keep the value on the device as a tensor"),
}

# Calls that wait for the device whatever their arguments: (owner, attribute, what).
DEVICE_SYNCS = ((torch.cuda, "synchronize", "torch.cuda.synchronize()"),
                (torch.cuda, "empty_cache", "torch.cuda.empty_cache()"),
                (torch.cuda.Stream, "synchronize", "Stream.synchronize()"),
                (torch.cuda.Event, "synchronize", "Event.synchronize()"))


def op_sync_rule(func: Any, args: Sequence[Any], kwargs: dict, on_cuda: bool) -> Optional[SyncRule]:
    """The first rule by which running `func(*args, **kwargs)` would make the host wait, or None.

    `on_cuda` says what "the device" is: False for the emulate driver and the plan, which model the CPU as the
    device (every tensor is device memory, Python data entering a tensor is a host-to-device copy); True for a
    real CUDA capture, where only CUDA tensors are device memory."""
    return next((rule for rule in OP_RULES if rule.applies(func, args, kwargs, on_cuda)), None)


def copy_detail(func: Any, args: Sequence[Any], kwargs: dict) -> Optional[str]:
    """What a host/device copy does, for the guard's message (None: not such a copy)."""
    return _copy_between_host_and_device(func, args, kwargs)


"""Tensor and storage helpers the runtime shares: copies into and out of graph buffers that keep any layout,
storage addresses, parameters and buffers as seen at run time, and wrapper subclasses seen through to the
plain tensors that hold their data.

**Copies keeping any layout**: expanded (stride 0), non-contiguous, with a storage offset, or empty.

A CUDA graph reads and writes fixed addresses, so a static buffer must have its argument's exact strides (the
captured kernels were specialised for them). An expanded tensor repeats one element along its stride-0
dimensions; `copy_` refuses such a destination ("more than one element of the written-to tensor refers to a
single memory location"), so a copy writes only the *core*: the tensor with each stride-0 dimension narrowed
to one element, which holds every distinct element exactly once.

**Wrapper subclasses** (DTensor, torchao's float8 / NF4 tensors) are seen through to the plain tensors that hold
their data.

A DTensor parameter has no memory of its own: its data is its local shard, an ordinary tensor. aot_autograd
flattens such wrappers into their inner tensors before the graphs we capture run (and wraps the graphs' outputs
again), so graph inputs, parameter addresses and the memory registry are all plain tensors already. What still
holds the wrappers is the partition's view of a call, its arguments as Dynamo passes them (which storages are
parameters), and the frame's outputs (whether one lives in graph memory). Those go through here. The graph-bank
key reads a wrapper argument's own metadata (its global shape, dtype): its placements and mesh are fixed by the
graph itself and by Dynamo's guards on the frame's inputs.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, List, Optional, Sequence

import torch

from .. import _compat


def broadcast_core(t: torch.Tensor) -> torch.Tensor:
    """t with each stride-0 dimension narrowed to length 1: every distinct element once."""
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            t = t.narrow(dim, 0, 1)
    return t


def overlaps_itself(t: torch.Tensor) -> bool:
    """Could two elements of t share memory? Conservative: False means surely not."""
    span = 0
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def uncopyable_reason(t: torch.Tensor) -> Optional[str]:
    """Why no static buffer can stand for t, or None: only overlap that is not a plain repeat (a sliding window
    built with as_strided) is left."""
    if overlaps_itself(broadcast_core(t)):
        return (f"its memory overlaps itself (strides {tuple(t.stride())} for shape {tuple(t.shape)}, e.g. from "
                f"as_strided or unfold), which no static buffer can mirror; pass .contiguous() there")
    return None


def same_repeats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b repeat along the same dimensions (b's values fit a's buffer layout)."""
    return all((sa == 0) == (sb == 0) for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def static_copy(t: torch.Tensor) -> torch.Tensor:
    """A buffer with t's exact shape and strides (stride 0 kept), holding t's values."""
    buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    copy_into(buf, t)
    return buf


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a dst of any layout: an expanded dst gets src's core written once. The caller makes
    sure src repeats along dst's stride-0 dimensions (same_repeats), as its values are then equal there."""
    core = broadcast_core(dst)
    if core is dst:
        dst.copy_(src)
    elif not same_repeats(dst, src):
        raise RuntimeError(f"cannot copy a tensor with strides {tuple(src.stride())} into a buffer that repeats "
                           f"along its stride-0 dimensions (strides {tuple(dst.stride())})")
    else:
        core.copy_(src[tuple(slice(0, n) for n in core.shape)])


def at_positions(positions: Sequence[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """A C function taking a call's arguments to those at `positions`, as a sequence (operator.itemgetter; for one
    position a slice of them, as itemgetter would return the element itself)."""
    if len(positions) == 1:
        return operator.itemgetter(slice(positions[0], positions[0] + 1))
    return operator.itemgetter(*positions) if positions else operator.itemgetter(slice(0, 0))


def is_param_or_buffer(arg: Any) -> bool:
    """A parameter or buffer seen at run time: nn.Parameter, or a tensor Dynamo marked static (it marks module
    buffers too). Their addresses stay fixed between calls, so graphs read them in place."""
    return isinstance(arg, torch.nn.Parameter) or (
        isinstance(arg, torch.Tensor) and hasattr(arg, "_dynamo_static_input_type"))


def registered_parameter(arg: Any) -> bool:
    """A parameter object as a module registers it: of a Parameter type, or a tensor subclass made a parameter
    (nn.Parameter(DTensor) keeps the DTensor type and flags it). A plain tensor merely flagged `_is_param` passes
    isinstance(x, nn.Parameter) but is no registered object (DTensor.to_local() of a parameter: new every call)."""
    return issubclass(type(arg), torch.nn.Parameter) or (
        _compat.is_wrapper_subclass(arg) and getattr(arg, "_is_param", False))


def flagged_parameter(arg: Any) -> bool:
    """A tensor flagged `_is_param` (so isinstance(x, nn.Parameter) holds) that is no registered parameter object:
    e.g. DTensor.to_local() of an FSDP2 parameter, a fresh object on every call."""
    return getattr(arg, "_is_param", False) and not registered_parameter(arg)


def storage_ptr(t: torch.Tensor) -> int:
    """The address of t's storage (0 for a storage without memory): the key of the memory registry."""
    return _compat.storage_key(t)[0]


def inner_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    """The plain tensors holding t's data, in aot_autograd's flattening order: [t] for a plain tensor; for a wrapper
    subclass, the tensor attributes `__tensor_flatten__` names, recursively (a DTensor: its local shard)."""
    if type(t) is torch.Tensor or not _compat.is_wrapper_subclass(t):  # a plain tensor without the subclass test:
        return [t]  # the steady path asks this of every output (2-3 µs a step in a real decode loop, measured)
    names, _ = t.__tensor_flatten__()
    attributes = [getattr(t, name) for name in names]  # DTensor's include its device mesh, which holds no data
    return [inner for value in attributes if isinstance(value, torch.Tensor) for inner in inner_tensors(value)]

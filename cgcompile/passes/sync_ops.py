"""Host syncs: ops that make the CPU wait for a device value. They cannot run inside a CUDA graph
("operation not permitted when stream is capturing"), so they stay eager."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.fx as fx

from ..reasons import Finding, Reason
from .common import (compute_nodes, example_value, finding, has_tag, input_unbacked_symbols, is_scalar_input_read,
                     unbacked_symbols)
from .padding_marks import PADDED, bucketed_read

_SCALAR_METHODS = {
    "item": "keep the value on the device as a 0-d tensor (e.g. torch.where instead of a Python if)",
    "tolist": "use fixed split sizes (pad each group to a capacity) so no host copy is needed",
    "__bool__": "avoid Python control flow on tensor values; use torch.where",
    "__int__": "keep the value on the device as a tensor",
    "__float__": "keep the value on the device as a tensor",
    "numpy": "move the host copy out of the captured region",
    "cpu": "move the host copy out of the captured region, or keep the tensor on the device",
}
_CPU_COPY_HINT = _SCALAR_METHODS["cpu"]

# Library custom ops whose kernel reads a device value on the host. Their schema cannot say so (an opaque
# op), yet a CUDA capture fails on them, so the plan must keep them eager: op name -> (detail, hint).
_SYNCING_LIBRARY_OPS = {
    "transformers::grouped_mm_fallback": (
        "transformers' grouped-mm fallback (fp32 or fp16 weights under torch.compile) reads the expert "
        "offsets with offs.tolist()",
        "train with bfloat16 weights (transformers then calls torch._grouped_mm, no host read) or "
        "experts_implementation='batched_mm'"),
}


def _device_of(node) -> "torch.device | None":
    value = example_value(node) if isinstance(node, fx.Node) else None
    return value.device if isinstance(value, torch.Tensor) else None


def _moves_to_host(node: fx.Node, destination) -> bool:
    """Whether a move to `destination` copies device memory to the host on the GPU the plan stands for.

    A string ("cpu") or `.cpu()` says "to the host" whatever device the model is on: a sync on a GPU. A
    torch.device object is what `x.device` or a device variable becomes in the graph, so it is compared with
    the tensor's own device: equal devices make the move a no-op, on the CPU as on a GPU (`inv_freq.to(x.device)`
    in RoPE). A literal torch.device("cpu") on a CPU model is therefore taken for a no-op too; on a GPU model,
    where it is a real move, it is found.
    """
    if isinstance(destination, str):
        return destination.split(":")[0] == "cpu"
    if not isinstance(destination, torch.device) or destination.type != "cpu":
        return False
    source = _device_of(node.args[0]) if node.args else None
    return source is None or source != destination


def _copies_to_cpu(node: fx.Node) -> bool:
    """`.to("cpu")`, `.to(device="cpu")`, `.to(torch.device("cpu"))` from a tensor on another device.
    Dtype-only `.to(dtype)` and moves between equal devices are no-ops, not syncs."""
    is_to = (node.op == "call_method" and node.target == "to") or node.target is torch.Tensor.to
    if not is_to:
        return False
    candidates = list(node.args[1:]) + [node.kwargs.get("device")]
    return any(_moves_to_host(node, v) for v in candidates)


def _library_op_name(node: fx.Node) -> "str | None":
    """'namespace::op' of a library op called through any of its overloads (some, like aten.slice, have no
    default overload), else None."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if not isinstance(target, torch._ops.OpOverloadPacket):
        return None
    return str(target).replace(".", "::", 1)


def _produces_unbacked_scalar(node: fx.Node) -> bool:
    """A new Python scalar (SymInt/SymFloat/SymBool) known only at run time came off the device. Arithmetic on
    existing symbols (u0 >= 0, sizes of a nonzero result) creates no new symbol and is not a sync."""
    value = example_value(node)
    values = value if isinstance(value, (list, tuple)) else [value]
    scalars = [v for v in values if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))]
    if not scalars:
        return False
    known = input_unbacked_symbols(node)
    return any(unbacked_symbols(v, known) for v in scalars)


def find_host_syncs(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    found: Dict[fx.Node, List[Finding]] = {}
    for node in compute_nodes(gm):
        if is_scalar_input_read(node):
            continue  # reported by scalar_inputs.py: a host number known on entry, not a device read
        producer = bucketed_read(node)
        if producer is not None:
            padding = producer.meta[PADDED]
            what = (f"the largest of {padding.group} selected row counts" if padding.group > 1
                    else "the selected row count")
            found[node] = [finding(producer, Reason.HOST_SYNC, op=padding.op,
                                   hint="dynamic_padding='max' needs no host read at all",
                                   detail=f"dynamic_padding='buckets' reads {what} on the host once and pads "
                                          f"to the next bucket")]
            continue
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
        if node.op == "call_method" and name in _SCALAR_METHODS:
            found[node] = [finding(node, Reason.HOST_SYNC, hint=_SCALAR_METHODS[name],
                                   detail=f"Tensor.{name}() copies a device value to the host")]
        elif node.target in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            found[node] = [finding(node, Reason.HOST_SYNC, hint=_SCALAR_METHODS["item"],
                                   detail="reads a device scalar on the host")]
        elif _library_op_name(node) in _SYNCING_LIBRARY_OPS:
            detail, hint = _SYNCING_LIBRARY_OPS[_library_op_name(node)]
            found[node] = [finding(node, Reason.HOST_SYNC, hint=hint, detail=detail)]
        elif _copies_to_cpu(node):
            found[node] = [finding(node, Reason.HOST_SYNC, hint=_CPU_COPY_HINT, detail="copies a tensor to the CPU")]
        elif has_tag(node, torch.Tag.data_dependent_output):
            found[node] = [finding(node, Reason.HOST_SYNC, hint="compare on the device and keep the result a tensor",
                                   detail="its Python result depends on device values")]
        elif _produces_unbacked_scalar(node):
            found[node] = [finding(node, Reason.HOST_SYNC, hint=_SCALAR_METHODS["item"],
                                   detail="produces a Python scalar from device data")]
    return found

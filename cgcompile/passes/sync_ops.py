"""Host syncs: ops that make the CPU wait for a device value. They cannot run inside a CUDA graph
("operation not permitted when stream is capturing"), so they stay eager.

The rules are cgcompile/sync_rules.py's, the ones the capture guard applies at run time: each node is read as
the aten call it makes (`t[mask] = v` is `index_put_` with a boolean index) and asked of that table, so the plan
never marks "capture" what the guard would reject. The bodies of higher-order ops (an autograd.Function,
`wrap`) are read too: a sync inside makes the whole op eager."""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Dict, List

import torch
import torch.fx as fx

from .. import _compat
from ..code_source import CodeSource, host_read_hint, source_of
from ..reasons import Finding, Reason
from ..sync_rules import DEVICE_SYNCS, HOST_COPY_HINT, TENSOR_READS, op_sync_rule
from .common import (aten_packet, compute_nodes, example_value, finding, input_unbacked_symbols,
                     is_scalar_input_read, module_stack, node_location, unbacked_symbols)
from .padding_marks import PADDED, bucketed_read

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


def _example_arguments(node: fx.Node) -> tuple:
    return fx.node.map_arg((node.args, node.kwargs), example_value)


def _index_list(index: Any) -> "list | None":
    """The aten indices of a Python subscript holding a tensor (`t[mask]`, `t[:, idx]`), else None."""
    items = list(index) if isinstance(index, (tuple, list)) else [index]
    return items if any(isinstance(i, torch.Tensor) for i in items) else None


def _checks_linalg_errors(node: fx.Node) -> bool:
    """torch.linalg.inv, .cholesky, .solve, .lu_factor, .ldl_factor (torch._C._linalg.linalg_inv in the graph):
    an `_ex` twin exists because the plain form reads its error codes on the host; torch.inverse is linalg.inv."""
    target = node.target
    if target is torch.inverse or (node.op == "call_method" and target == "inverse"):
        return True
    name = getattr(target, "__name__", None)
    return (node.op == "call_function" and isinstance(name, str) and getattr(torch._C._linalg, name, None) is target
            and hasattr(torch._C._linalg, f"{name}_ex"))


def aten_call(node: fx.Node) -> "tuple | None":
    """(op, args, kwargs): the aten call a graph node makes, with the values Dynamo recorded, as the sync
    rules read it (an overload where the arguments select one, else the overload packet); None for no aten op."""
    args, kwargs = _example_arguments(node)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target, args, kwargs
    if target in (operator.setitem, operator.getitem) and args and isinstance(args[0], torch.Tensor):
        indices = _index_list(args[1])
        if indices is None:
            return None
        if target is operator.setitem:
            return torch.ops.aten.index_put_, (args[0], indices, args[2]), {}
        return torch.ops.aten.index, (args[0], indices), {}
    if _checks_linalg_errors(node):
        return torch.ops.aten._linalg_check_errors, (), {}
    if target in (torch.tensor, torch.as_tensor) and args and not isinstance(args[0], torch.Tensor):
        return None  # Python data in a traced graph is a constant aot lifts at trace time: no copy at run time
    packet = aten_packet(node)
    if packet is None:
        return None
    return _compat.resolve_overload(packet, args, kwargs) or packet, args, kwargs


def _is_device_sync(node: fx.Node) -> "str | None":
    """What a call that waits for the device is (a method call names every class that has such a method)."""
    if node.op == "call_method":
        whats = [what for owner, name, what in DEVICE_SYNCS if isinstance(owner, type) and name == node.target]
        return " or ".join(whats) or None
    return next((what for owner, name, what in DEVICE_SYNCS if node.target is getattr(owner, name, None)), None)


def _node_source(node: fx.Node) -> CodeSource:
    """Whose code the op is written in: the file of its line, else its innermost module's class."""
    location = node_location(node)
    stack = module_stack(node)
    module = getattr(stack[-1][1], "__module__", None) if stack else None
    return source_of(location.rpartition(":")[0] if location else None, module)


def _node_findings(node: fx.Node, nested: bool) -> List[Finding]:
    """Why the node syncs, by the shared rules, with the fix worded for whose code it is (a library's knob
    where the user cannot edit the line)."""
    if _library_op_name(node) in _SYNCING_LIBRARY_OPS:  # the library's own op: its hint names its own fix
        detail, hint = _SYNCING_LIBRARY_OPS[_library_op_name(node)]
        return [finding(node, Reason.HOST_SYNC, hint=hint, detail=detail)]
    found = _rule_findings(node, nested)
    if not found:
        return found
    source = _node_source(node)
    return [replace(f, hint=host_read_hint(source, f.hint)) for f in found]


def _rule_findings(node: fx.Node, nested: bool) -> List[Finding]:
    """At the top level the rules of other categories (a dynamic shape, an op tagged cudagraph_unsafe) are left
    to their own passes; inside a higher-order op's body no other pass looks, so every rule counts there."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    if node.op == "call_method" and name in TENSOR_READS:
        return [finding(node, Reason.HOST_SYNC, hint=TENSOR_READS[name].hint,
                        detail=f"Tensor.{name}() copies a device value to the host")]
    if _copies_to_cpu(node):
        return [finding(node, Reason.HOST_SYNC, hint=HOST_COPY_HINT, detail="copies a tensor to the CPU")]
    device_sync = _is_device_sync(node)
    if device_sync is not None:
        return [finding(node, Reason.HOST_SYNC, hint="move it out of the captured region",
                        detail=f"{device_sync} waits for the device")]
    call = aten_call(node)
    rule = op_sync_rule(*call, on_cuda=False) if call is not None else None
    if rule is not None and (nested or rule.reason is Reason.HOST_SYNC):
        category: Reason = rule.reason
        return [finding(node, category, hint=rule.hint, detail=f"{call[0]} {rule.detail}")]
    if _produces_unbacked_scalar(node):
        return [finding(node, Reason.HOST_SYNC, hint=TENSOR_READS["item"].hint,
                        detail="produces a Python scalar from device data")]
    return []


def _body_findings(gm: fx.GraphModule, node: fx.Node) -> List[Finding]:
    """The syncs inside the graph bodies a higher-order op runs (an autograd.Function's forward and backward)."""
    if not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    found: List[Finding] = []
    for body_node in node.all_input_nodes:
        body = getattr(gm, body_node.target, None) if body_node.op == "get_attr" else None
        if isinstance(body, fx.GraphModule):
            for inner in compute_nodes(body):
                found += _node_findings(inner, nested=True) + _body_findings(body, inner)
    return found


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
        findings = _node_findings(node, nested=False) + _body_findings(gm, node)
        if findings:
            found[node] = findings
    return found

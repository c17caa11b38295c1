"""Host tensors on a graph that runs on an accelerator: what reads them stays eager.

A CUDA graph replays device work only. Host work in the captured code ran once, at capture, and a CUDA kernel
that takes a 0-d CPU tensor as an operand (`x * scale`, which eager allows) reads its value on the host at
launch, so the graph keeps the value it had at capture: a replay with a new `scale` would silently compute with
the old one. torch's own CUDA graphs skip a graph with CPU tensors for the same reason.

So on a frame that runs on an accelerator (devices.py: where its tensor inputs mostly are):
- every op that reads a CPU tensor input stays eager (`host_tensor`), and so does every op that reads a CPU
  tensor computed from one;
- a CPU tensor the code makes from constants (`h * torch.tensor(2.0)`) is the same at every call, so a kernel
  keeping its value is exact and stays captured; but copying one into device memory (`torch.arange(n).to(dev)`,
  or indexing a device tensor with it) is a copy from pageable host memory, which waits for the host and which a
  capture rejects (the CUDA driver's guard, sync_rules.py's `host_device_copy`): `host_sync`, at plan time.
Reading only a host tensor's shape or dtype reads no data. Nothing is flagged on a CPU frame: the CPU is then the
device (the emulate driver's model). Python numbers Dynamo passes as 0-d tensors are scalar_inputs.py's: their
read is hoisted, and the number reaches the graphs as an argument.
"""

from __future__ import annotations

from typing import Any, Dict, List, Set

import torch
import torch.fx as fx

from .. import _compat
from ..devices import device_of
from ..reasons import Finding, Reason
from .common import compute_nodes, example_value, finding, input_description, is_scalar_input_read

__all__ = ["find_host_tensor_reads"]

HINT = ("move the tensor to the model's device before the call (`t.to(device)`), or pass a Python number; "
        "a CUDA graph keeps the value a host tensor had at capture")
COPY_HINT = "create the tensor on the device (`torch.arange(n, device=x.device)`)"
_MOVES = frozenset({"to", "cuda", "copy_"})
_MOVE_FUNCTIONS = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_, torch.ops.aten._to_copy.default,
                             torch.ops.aten.copy_.default, torch.ops.aten.copy.default})
# reads of a tensor's metadata, not of its values
_METADATA_METHODS = frozenset({"size", "dim", "stride", "numel", "element_size", "is_contiguous", "get_device"})
_METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"})


def _device_types(value: Any) -> Set[str]:
    """The device types of the tensors in a node's value (a tensor, or a tuple or list of them)."""
    return {t.device.type for t in _compat.tree_flatten(value)[0] if isinstance(t, torch.Tensor)}


def _holds_host_tensor(value: Any) -> bool:
    return "cpu" in _device_types(value)


def _holds_device_tensor(value: Any) -> bool:
    return bool(_device_types(value) - {"cpu"})


def _reads_metadata_only(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.target is getattr and len(node.args) > 1:
        return node.args[1] in _METADATA_ATTRS
    return node.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default)


def _on_accelerator(gm: fx.GraphModule) -> bool:
    return device_of([example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]).type != "cpu"


def _is_host_input(node: fx.Node) -> bool:
    return node.op == "placeholder" and _holds_host_tensor(example_value(node)) \
        and not any(is_scalar_input_read(user) for user in node.users)


def _copies_to_device(node: fx.Node, operand: fx.Node) -> bool:
    """Does the op copy the host tensor `operand` into device memory? A move (`.to(device)`, `.cuda()`,
    `copy_`) does; so does any device op on a host tensor that is not 0-d (eager moves it first, as indexing
    with a CPU index does). A 0-d operand of a device kernel is passed by value, no copy."""
    if not _holds_device_tensor(example_value(node)):
        return False
    value = example_value(operand)
    if node.op == "call_method":  # `host.type_as(device_tensor)` copies the host tensor to the device
        moves = node.target in _MOVES or (node.target == "type_as" and bool(node.args) and node.args[0] is operand)
    else:
        moves = node.target in _MOVE_FUNCTIONS
    return moves or not (isinstance(value, torch.Tensor) and value.dim() == 0)


def find_host_tensor_reads(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    """On an accelerator graph: every op that reads a host tensor whose value can change between calls (an
    input, or computed from one or from device data) stays eager (host_tensor); every copy into device memory of
    a host tensor the code made from constants is a host_sync (a copy from pageable memory)."""
    if not _on_accelerator(gm):
        return {}
    # host tensors whose value can change between calls -> the input or op that makes them so
    varying: Dict[fx.Node, fx.Node] = {n: n for n in gm.graph.nodes if _is_host_input(n)}
    made: Set[fx.Node] = set()  # host tensors the code made from constants
    found: Dict[fx.Node, List[Finding]] = {}
    for node in compute_nodes(gm):
        if _reads_metadata_only(node):
            continue
        read = next((a for a in node.all_input_nodes if a in varying), None)
        if _holds_host_tensor(example_value(node)):
            if read is not None:
                varying[node] = varying[read]
            elif any(_holds_device_tensor(example_value(a)) for a in node.all_input_nodes):
                varying[node] = node  # device data brought to the host (a sync, sync_ops.py's finding)
            else:
                made.add(node)
        if read is not None:
            found[node] = [finding(node, Reason.HOST_TENSOR, hint=HINT, detail=(
                f"reads {_described(read, varying[read])} on a graph that runs on the device: a CUDA graph replays "
                f"no host work, and its kernels keep a host operand's value from the capture"))]
            continue
        constant = next((a for a in node.all_input_nodes if a in made), None)
        if constant is not None and _copies_to_device(node, constant):
            found[node] = [finding(node, Reason.HOST_SYNC, hint=COPY_HINT, detail=(
                f"copies {input_description(constant)}, a tensor in host memory, to the device: a copy from "
                f"pageable host memory waits for the host, which a capture cannot hold"))]
    return found


def _described(read: fx.Node, source: fx.Node) -> str:
    if read is source:
        kind = "a tensor in host memory" if source.op == "placeholder" else "a host tensor made at each call"
        return f"{input_description(source)}, {kind},"
    return f"{input_description(read)}, a host tensor computed from {input_description(source)},"

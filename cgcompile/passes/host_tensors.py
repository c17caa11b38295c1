"""Host tensors a graph on an accelerator takes as inputs: what reads them stays eager.

A CUDA graph replays device work only. Host work in the captured code ran once, at capture, and a CUDA kernel
that takes a 0-d CPU tensor as an operand (`x * scale`, which eager allows) reads its value on the host at
launch, so the graph keeps the value it had at capture: a replay with a new `scale` would silently compute with
the old one. torch's own CUDA graphs skip a graph with CPU tensors for the same reason.

So on a frame that runs on an accelerator (devices.py: where its tensor inputs mostly are), every op that reads
a CPU tensor input stays eager, and so does every op that reads a CPU tensor computed from one. A CPU tensor the
code makes from constants (`hidden * torch.tensor(d ** 0.5)`, as HF Gemma does) is the same at every call, so
keeping it in the graph is exact and it is not flagged. Nothing is flagged on a CPU frame: the CPU is then the
device (the emulate driver's model). Python numbers Dynamo passes as 0-d tensors are scalar_inputs.py's: their
read is hoisted, and the number reaches the graphs as an argument.
"""

from __future__ import annotations

from typing import Any, Dict, List, Set

import torch
import torch.fx as fx

from ..devices import device_of
from ..reasons import Finding, Reason
from .common import compute_nodes, example_value, finding, input_description, is_scalar_input_read

__all__ = ["find_host_tensor_reads"]

HINT = ("move the tensor to the model's device before the call (`t.to(device)`), or pass a Python number; "
        "a CUDA graph keeps the value a host tensor had at capture")
# reads of a tensor's metadata, not of its values
_METADATA_METHODS = frozenset({"size", "dim", "stride", "numel", "element_size", "is_contiguous", "get_device"})
_METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"})


def _holds_host_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "cpu"
    if isinstance(value, (list, tuple)):
        return any(_holds_host_tensor(v) for v in value)
    return False


def _reads_metadata_only(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.target is getattr and len(node.args) > 1:
        return node.args[1] in _METADATA_ATTRS
    return node.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default)


def _host_inputs(gm: fx.GraphModule) -> Set[fx.Node]:
    """The placeholders holding CPU tensors when the graph runs on an accelerator (none on a CPU graph)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if device_of([example_value(n) for n in placeholders]).type == "cpu":
        return set()
    return {n for n in placeholders if _holds_host_tensor(example_value(n))
            and not any(is_scalar_input_read(user) for user in n.users)}


def find_host_tensor_reads(gm: fx.GraphModule) -> Dict[fx.Node, List[Finding]]:
    """Every op of an accelerator graph that reads a host tensor input, or a host tensor computed from one."""
    host = _host_inputs(gm)
    if not host:
        return {}
    origin: Dict[fx.Node, fx.Node] = {n: n for n in host}  # a host value -> the input it comes from
    found: Dict[fx.Node, List[Finding]] = {}
    for node in compute_nodes(gm):
        read = next((a for a in node.all_input_nodes if a in origin), None)
        if read is None or _reads_metadata_only(node):
            continue
        if _holds_host_tensor(example_value(node)):
            origin[node] = origin[read]
        found[node] = [finding(node, Reason.HOST_TENSOR, hint=HINT, detail=f"reads {_described(read, origin[read])} "
                               "on a graph that runs on the device: a CUDA graph replays no host work, and its "
                               "kernels keep a host operand's value from the capture")]
    return found


def _described(read: fx.Node, source: fx.Node) -> str:
    if read is source:
        return f"{input_description(source)}, a tensor in host memory,"
    return f"{input_description(read)}, a host tensor computed from {input_description(source)},"

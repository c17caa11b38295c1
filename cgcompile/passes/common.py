"""What every pass needs: how to make a Finding (reasons.py) and how to name a node's op, user location and
module."""

from __future__ import annotations

import operator
import os
import re
from typing import Any, Iterator, List, Optional, Sequence

import sympy
import torch
import torch.fx as fx

from .. import _compat
from ..reasons import Finding, Reason

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_DYNAMO_ROOT = re.compile(r"^L\[['\"][^'\"]+['\"]\]\.?")
_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")
COMPUTE_OPS = ("call_function", "call_method", "call_module")
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def compute_nodes(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """Nodes that run an op (no placeholders, get_attr or output)."""
    return (n for n in gm.graph.nodes if n.op in COMPUTE_OPS)


def counts_as_op(node: fx.Node) -> bool:
    """Whether a node counts toward a partition's size: tuple unpacking is free at replay."""
    return node.op in COMPUTE_OPS and node.target is not operator.getitem


def node_location(node: fx.Node) -> Optional[str]:
    """The innermost frame of the node's stack trace outside torch itself, as 'file:line'.

    Dynamo inlines torch's own Python (`dist.all_reduce` -> `_functional_collectives`), so the innermost frame
    can be inside torch; the user's call is the last frame before it."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return None
    path, line = next(((p, n) for p, n in reversed(frames) if not os.path.abspath(p).startswith(_TORCH_DIR)),
                      frames[-1])
    return f"{path}:{line}"


_FRAME_FUNCTION = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_RESUMED = re.compile(r"torch_dynamo_resume_in_(\w+)_at_(\d+)$")


def _ops(gm: fx.GraphModule) -> List[fx.Node]:
    """A graph's op nodes: what its labels look at. A split partition's placeholder keeps the meta of the op before
    it that made the value (another module's code)."""
    return [node for node in gm.graph.nodes if node.op in ("call_function", "call_method", "call_module")]


def first_location(gm: fx.GraphModule) -> Optional[str]:
    """The user's file:line of a graph's first op with a stack trace (node_location)."""
    return next((loc for loc in map(node_location, _ops(gm)) if loc), None)


def frame_name(gm: fx.GraphModule) -> str:
    """Where a graph's code lives, for labels: the user's function running its first op, with the module class
    (`MoE.forward (moe.py:142)`; a frame Dynamo resumed after a graph break reads `fn, resumed after line N`).
    Code of torch's own modules (nn.Sequential) has no stack trace: then the module's class and path. Only its ops
    are looked at (_ops)."""
    ops = _ops(gm)
    for node in ops:
        frames = _FRAME_FUNCTION.findall(node.meta.get("stack_trace") or "")
        if not frames:
            continue
        path, line, function = next((f for f in reversed(frames) if not os.path.abspath(f[0]).startswith(_TORCH_DIR)),
                                    frames[-1])
        resumed = _RESUMED.match(function)
        if resumed:
            function = f"{resumed.group(1)}, resumed after line {resumed.group(2)}"
        users = [cls for _, cls in module_stack(node) if not getattr(cls, "__module__", "torch").startswith("torch.")]
        owner = f"{getattr(users[-1], '__name__', users[-1])}." if users else ""  # the module whose code runs
        return f"{owner}{function} ({os.path.basename(path)}:{line})"
    for node in ops:
        stack = module_stack(node)
        if stack:
            path, cls = stack[-1]
            return f"{getattr(cls, '__name__', cls)} {path or '(root)'}"
    return "?"


def input_description(node: fx.Node) -> str:
    """How a log names a value a partition takes from outside it: the user's argument and the line that reads
    it, or the op that produced it and its line ("argument `position_ids` (read at modeling_llama.py:123)")."""
    if node.op == "placeholder":
        source = _compat.graph_input_source(node)
        name = re.sub(r"^[LG]\.", "", _INDEX.sub(r".\1", source)) if source else node.name
        read = next((loc for loc in map(node_location, node.users) if loc), None)
        return f"argument `{name}`" + (f" (read at {short_location(read)})" if read else "")
    location = node_location(node)
    return f"`{node.name}` from {op_name(node)}" + (f" (created at {short_location(location)})" if location else "")


def short_location(location: Optional[str]) -> str:
    """'file.py:12' for tables; the JSON keeps the full path."""
    return os.path.basename(location) if location else "?"


def clean_module_path(dynamo_path: str) -> str:
    """Dynamo's "L['self'].layers[0].attn" -> "layers.0.attn" (the root's name depends on forward's signature)."""
    path = _INDEX.sub(r".\1", _DYNAMO_ROOT.sub("", dynamo_path))
    return ".".join(part for part in path.split(".") if part and part != "_modules")


def module_stack(node: fx.Node) -> list:
    """[(clean path, module class), ...] from outermost to innermost module."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(clean_module_path(path), cls) for path, cls in stack.values()]


def node_module_path(node: fx.Node) -> Optional[str]:
    stack = module_stack(node)
    return stack[-1][0] or None if stack else None


def op_name(node: fx.Node) -> str:
    """A readable name for the op a node runs: 'torch.nonzero', 'Tensor.item', 'aten.nonzero.default'."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return str(target)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    name = getattr(target, "__name__", None) or str(target)
    if getattr(torch, name, None) is target or getattr(torch.nn.functional, name, None) is target:
        return f"torch.{name}" if getattr(torch, name, None) is target else f"F.{name}"
    if getattr(operator, name, None) is target:
        return f"operator.{name}"
    if getattr(torch._C._nn, name, None) is target:
        return f"F.{name}"
    wrapped = dynamo_wrapped_name(target)
    if wrapped is not None:
        return f"Tensor.{wrapped}" if name.startswith("prim_") else f"DTensor.{wrapped}"
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if module else name


def dynamo_wrapped_name(target: Any) -> Optional[str]:
    """torch 2.11's Dynamo puts DTensor calls in the graph as wrappers of its own named for them: x.redistribute(...)
    as "prim_redistribute", DTensor.from_local(...) as "prim from_local" (torch 2.13: the method or function
    itself). The wrapped call's name ("redistribute", "from_local"), else None."""
    name = getattr(target, "__name__", None)
    if isinstance(name, str) and name.startswith(("prim_", "prim ")) and \
            str(getattr(target, "__module__", "")).startswith("torch._dynamo."):
        return name[5:]
    return None


def finding(node: fx.Node, category: Reason, *, hint: Optional[str] = None, detail: Optional[str] = None,
            op: Optional[str] = None, downstream: bool = False) -> Finding:
    return Finding(category, op or op_name(node), node_location(node), node_module_path(node), hint, detail,
                   downstream)


def example_value(node: fx.Node) -> Any:
    """The fake value Dynamo recorded for the node (a FakeTensor, SymInt, or a tuple of them)."""
    meta = node.meta
    return meta["example_value"] if "example_value" in meta else meta.get("val")


def is_static_placeholder(node: fx.Node) -> bool:
    """Parameters and buffers: Dynamo marks them, and their addresses stay fixed between calls."""
    if node.op != "placeholder":
        return False
    if (node.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type"):
        return True
    return isinstance(example_value(node), torch.nn.Parameter)


def op_key(node: fx.Node) -> str:
    """The op's plain name ('mul', 'index_add_', 'linear', 'getitem'), for torch functions, Tensor methods,
    operator functions and aten overloads alike (op_name is the qualified name shown to users)."""
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return dynamo_wrapped_name(target) or getattr(target, "__name__", str(target))


def aten_packet(node: fx.Node):
    """The aten overload packet a torch-level node maps to, if any (torch.nonzero -> aten.nonzero)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target
    if node.op not in ("call_function", "call_method") or (node.op == "call_function"
                                                           and not isinstance(getattr(target, "__name__", None), str)):
        return None
    name = op_key(node)
    if name.startswith("_"):
        return None
    if node.op == "call_function" and getattr(torch, name, None) is not target \
            and getattr(torch.Tensor, name, None) is not target:
        return None
    return getattr(torch.ops.aten, name, None)


def has_tag(node: fx.Node, tag: "torch.Tag") -> bool:
    """Whether the op the node calls carries `tag`. For a torch-level call that is the aten overload its
    arguments select (`repeat_interleave(x, 2)` is `.self_int`, static; `repeat_interleave(counts)` is
    `.Tensor`, data-dependent), resolved from the values Dynamo recorded; when the overloads of the op agree,
    or the call cannot be resolved, any overload carrying the tag counts."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return tag in target.tags
    packet = aten_packet(node)
    if packet is None:
        return False
    try:
        overloads = [getattr(packet, name) for name in packet.overloads()]
    except (AttributeError, RuntimeError):
        return False
    tagged = [tag in o.tags for o in overloads]
    if all(tagged) or not any(tagged):
        return bool(tagged) and tagged[0]
    called = _compat.resolve_overload(packet, *_example_arguments(node))
    return tag in called.tags if called is not None else True


def _example_arguments(node: fx.Node) -> tuple:
    """The node's (args, kwargs) with each input node replaced by the value Dynamo recorded for it."""
    return fx.node.map_arg((node.args, node.kwargs), example_value)


def is_scalar_input_read(node: fx.Node) -> bool:
    """`.item()` of a graph input that Dynamo made from a Python number (with dynamic=True it passes floats such
    as a LayerNorm eps as 0-d CPU tensors and reads them back). A host value known on entry, not a device sync.

    Reads Dynamo's private `grapharg` node meta (GraphArg.pass_arg_as_tensor; checked on torch 2.11 and 2.13)."""
    if node.op != "call_method" or node.target != "item" or not node.args:
        return False
    source = node.args[0]
    if not isinstance(source, fx.Node) or source.op != "placeholder":
        return False
    return bool(getattr(source.meta.get("grapharg"), "pass_arg_as_tensor", False))


# Python's in-place operators (x += y traces as operator.iadd): they write their first argument
_IN_PLACE_OPERATORS = frozenset({"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand",
                                  "ior", "ixor", "ilshift", "irshift", "imatmul"})
# ops whose result shares its first argument's memory: a write through them writes that argument
ALIASING_OPS = frozenset({"view", "reshape", "view_as", "transpose", "permute", "squeeze", "unsqueeze", "narrow",
                          "select", "expand", "t", "flatten", "unflatten", "as_strided", "getitem", "__getitem__",
                          "detach"})


def schema_writes(schema: Any, args: Sequence[Any], kwargs: dict) -> List[Any]:
    """The argument values an op with this schema writes in place (its alias annotations say `a!`)."""
    if not schema.is_mutable:
        return []
    values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
    return [value for value, arg in zip(values, schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write and value is not None]


def written_args(node: fx.Node) -> List[fx.Node]:
    """The nodes an op writes in place: by its schema (aten overloads), its name (`x.add_()`, `torch.relu_`,
    `x += y`, `x[i] = y`), or its `out=` argument. The one answer every pass and the runtime use."""
    if node.op not in ("call_function", "call_method"):
        return []
    if isinstance(node.target, torch._ops.OpOverload):
        written = schema_writes(node.target._schema, node.args, node.kwargs)
    else:
        name = op_key(node)
        in_place = name in _IN_PLACE_OPERATORS if getattr(operator, name, None) is node.target else (
            name.endswith("_") and not name.endswith("__"))
        written = [node.args[0]] if in_place and node.args else []
        if node.kwargs.get("out") is not None:
            written.append(node.kwargs["out"])
    return [w for w in written if isinstance(w, fx.Node)]


def is_aten_view(node: fx.Node) -> bool:
    """Is node an aten op returning a view of its first argument (its schema's alias annotation without a write)?
    For aot's aten graphs, where every view op says so (`slice`, `diagonal`, `alias` included)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or not node.args:
        return False
    arguments = node.target._schema.arguments
    alias = arguments[0].alias_info if arguments else None
    return alias is not None and not alias.is_write and isinstance(node.args[0], fx.Node)


def aten_view_root(node: fx.Node) -> fx.Node:
    """view_root for aot's aten graphs: the tensor a chain of aten views (is_aten_view) starts from."""
    while is_aten_view(node):
        node = node.args[0]
    return node


def same_traced_layout(a: fx.Node, b: fx.Node) -> bool:
    """Do the two nodes' traced values (`meta["val"]`) have the same size, stride and dtype (readers of `a` may read
    `b` instead, as a rewrite that writes in place makes them)?"""
    x, y = a.meta.get("val"), b.meta.get("val")
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype \
        and tuple(x.shape) == tuple(y.shape) and tuple(x.stride()) == tuple(y.stride())


def view_root(node: fx.Node) -> fx.Node:
    """The tensor a chain of views/indexing starts from (what an in-place write through it changes)."""
    while node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node) \
            and op_key(node) in ALIASING_OPS:
        node = node.args[0]
    return node


def sym_expr(size: Any) -> Any:
    """A size as a sympy expression: a SymInt's expression, or the integer itself."""
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def unbacked_symbols(value: Any, known: Any = frozenset()) -> set:
    """The unbacked symbols (data-dependent sizes) in a fake value's shapes, minus `known`."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    try:
        return set(free_unbacked_symbols(value)) - set(known)
    except Exception:  # values that carry no shapes (None, strings, dtypes)
        return set()


def input_unbacked_symbols(node: fx.Node, known: Any = frozenset()) -> set:
    """The unbacked symbols the node's inputs carry (minus `known`): what it did not create itself."""
    symbols: set = set()
    for arg in node.all_input_nodes:
        symbols |= unbacked_symbols(example_value(arg), known)
    return symbols


def scalar_input_symbols(gm: fx.GraphModule) -> set:
    """The symbols of the Python numbers read by `is_scalar_input_read` nodes: known on entry, like backed sizes."""
    from torch.fx.experimental.symbolic_shapes import free_symbols
    symbols: set = set()
    for node in compute_nodes(gm):
        if is_scalar_input_read(node):
            symbols |= set(free_symbols(example_value(node)))
    return symbols

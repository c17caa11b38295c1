"""Where one size symbol's rows go, and whether every op treats those rows independently.

Padding a data-dependent dimension (dynamic_padding) or a batch dimension (capture_sizes) is exact only when the
rows added are garbage that never reaches a real row: every op on that dimension must be *row-wise* (the result
for row i depends on row i alone), and the rows may leave only through a *sink* that sums them away
(`index_add`, `index_put(accumulate=True)`, `scatter_add`, `sum` over the dimension), where the padding can be
masked with a select. Anything else (a softmax, mean or sort across the rows, the size read as a Python number, a
reshape that merges the dimension with another) is a *blocker*.

The analysis reads the shapes Dynamo recorded: a node's padded dimensions are exactly the output dimensions whose
size is the symbol itself (u0 from a `nonzero`, s0 from a dynamic batch), so no per-op shape rule is needed;
per-op rules only say whether an op mixes rows. Unknown ops are blockers: the answer is conservative, never wrong.
Pure: reads the graph, changes nothing.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from ..reasons import Finding, Reason
from .common import example_value, finding, op_key, op_name, sym_expr, unbacked_symbols

__all__ = ["RowFlow", "Sink", "row_flow"]

_COMPARE = {operator.ge, operator.gt, operator.le, operator.lt, operator.eq, operator.ne}
_ASSERT = torch.ops.aten._assert_scalar.default
_SYM_SIZE = torch.ops.aten.sym_size.int
# Conversions and copies: row-wise whatever their arguments.
_KEEP = {"to", "float", "half", "bfloat16", "double", "int", "long", "bool", "type", "type_as", "contiguous",
         "clone", "detach", "alias"}
_RESHAPE = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}
_MOVE = {"permute", "transpose", "t", "movedim", "moveaxis", "swapaxes", "swapdims"}
# Ops over one dim (argument position, default; None = the whole tensor): row-wise when that dim is not the
# padded one. `sum` over the padded dim is a sink instead.
_DIM_OPS = {
    "softmax": (1, "required"), "log_softmax": (1, "required"), "cumsum": (1, "required"),
    "cumprod": (1, "required"), "sum": (1, None), "mean": (1, None), "amax": (1, None), "amin": (1, None),
    "prod": (1, None), "logsumexp": (1, "required"), "var": (1, None), "std": (1, None), "norm": (2, None),
    "argmax": (1, None), "argmin": (1, None), "max": (1, None), "min": (1, None), "sort": (1, -1),
    "argsort": (1, -1), "topk": (2, -1), "cat": (1, 0), "concat": (1, 0), "split": (2, 0), "chunk": (2, 0),
    "unbind": (1, 0), "normalize": (2, 1),
}
_LAST_DIMS = {"layer_norm", "rms_norm"}  # normalize over the trailing len(normalized_shape) dims
_LINEAR = {"linear"}
_MATMUL = {"matmul", "mm", "bmm"}
_GATHER = {"getitem", "index_select"}
_SINKS = {"index_add", "index_add_", "index_put", "index_put_", "scatter_add", "scatter_add_"}


@dataclass(frozen=True)
class Sink:
    """An op that sums the padded rows away: `arg` is the position of the padded operand to mask (in
    node.args), `dim` its padded dimension."""

    node: fx.Node
    arg: int
    dim: int


@dataclass
class RowFlow:
    """The result for one symbol: per node, which output dims carry it; the sinks; the size reads that only
    feed Dynamo's runtime asserts (safe to drop once the size is fixed); the first blocker, if any."""

    symbol: Any
    dims: Dict[fx.Node, Tuple[int, ...]] = field(default_factory=dict)
    sinks: List[Sink] = field(default_factory=list)
    asserts: List[fx.Node] = field(default_factory=list)
    blocker: Optional[Finding] = None

    @property
    def ok(self) -> bool:
        return self.blocker is None


# operator-module names of Python's arithmetic (x * y, x += y) -> the aten op they run
_OPERATOR_ATEN = {"truediv": "div", "itruediv": "div", "floordiv": "floor_divide", "ifloordiv": "floor_divide",
                  "mod": "remainder", "imod": "remainder", "invert": "bitwise_not", "and_": "bitwise_and",
                  "iand": "bitwise_and", "or_": "bitwise_or", "ior": "bitwise_or", "xor": "bitwise_xor",
                  "ixor": "bitwise_xor", "iadd": "add", "isub": "sub", "imul": "mul", "ipow": "pow", "pos": "positive"}


def _pointwise(name: str) -> bool:
    name = _OPERATOR_ATEN.get(name, name)
    packet = getattr(torch.ops.aten, name.rstrip("_"), None)
    if packet is None or not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    try:
        return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
    except (AttributeError, RuntimeError):
        return False


def _symbols(value: Any) -> set:
    try:
        return set(free_symbols(value))
    except Exception:  # values with no shapes (None, dtypes, strings)
        return set()


def _shape(value: Any) -> Optional[Sequence[Any]]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def exact_dims(value: Any, sym) -> Tuple[Tuple[int, ...], bool]:
    """(dims whose size is exactly `sym`, whether some other dim's size involves sym)."""
    shape = _shape(value)
    if shape is None:
        return (), False
    dims, tangled = [], False
    for i, size in enumerate(shape):
        expr = sym_expr(size)
        if expr == sym:
            dims.append(i)
        elif sym in expr.free_symbols:
            tangled = True
    return tuple(dims), tangled


def _arg(node: fx.Node, pos: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[pos] if len(node.args) > pos else default


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _prod(sizes: Sequence[Any]) -> Any:
    result = sympy.Integer(1)
    for s in sizes:
        result = result * sym_expr(s)
    return sympy.simplify(result)


class _Walker:
    def __init__(self, gm: fx.GraphModule, sym, allow_sinks: bool):
        self.gm = gm
        self.sym = sym
        self.allow_sinks = allow_sinks
        self.flow = RowFlow(sym)
        self.carries: Dict[fx.Node, bool] = {}

    def block(self, node: fx.Node, why: str, hint: str) -> None:
        if self.flow.blocker is None:
            self.flow.blocker = finding(node, Reason.NOT_PADDABLE, hint=hint, detail=why)

    def run(self) -> RowFlow:
        for node in self.gm.graph.nodes:
            if self.flow.blocker is not None:
                break
            if node.op == "output":
                returned = next((a for a in node.all_input_nodes if self.carries.get(a)), None)
                if returned is not None:  # named by the op that made the returned tensor, at its line
                    self.block(returned, f"the compiled frame returns {op_name(returned)}'s result, sized by "
                                         f"{self.sym}",
                               "reduce the rows inside the compiled code (e.g. index_add into a fixed-size tensor)")
                continue
            value = example_value(node)
            carries = self.sym in _symbols(value)
            self.carries[node] = carries
            fed = [a for a in node.all_input_nodes if self.carries.get(a)]
            if not carries and not fed:
                continue
            if node.op == "placeholder":  # a batch symbol: the frame's inputs are where rows come from
                self.flow.dims[node] = exact_dims(value, self.sym)[0]
                continue
            if not fed:  # the origin of an unbacked symbol
                self.flow.dims[node] = exact_dims(value, self.sym)[0]
                continue
            self.visit(node, value, carries)
        return self.flow

    def dims_of(self, arg: Any) -> Tuple[int, ...]:
        return self.flow.dims.get(arg, ()) if isinstance(arg, fx.Node) else ()

    def visit(self, node: fx.Node, value: Any, carries: bool) -> None:
        name = op_key(node)
        others = unbacked_symbols(value, {self.sym}) if carries else set()
        if others:
            return self.block(node, f"{name} mixes {self.sym} with another data-dependent size "
                                    f"({', '.join(sorted(map(str, others)))})", "pad each dimension separately")
        if node.target is operator.setitem:
            return self.reduction(node, name)
        if isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool)) or value is None:
            return self.size_read(node, name)
        if not carries:
            return self.reduction(node, name)
        dims, tangled = exact_dims(value, self.sym) if isinstance(value, torch.Tensor) else ((), False)
        if tangled:
            return self.block(node, f"{name} merges the {self.sym} rows with another dimension",
                              "keep the row dimension whole (reshape only the other dimensions)")
        self.flow.dims[node] = dims
        if isinstance(value, (tuple, list)) and name not in ("where", "nonzero", "unbind", "split", "chunk", "topk",
                                                              "sort", "max", "min"):
            return self.block(node, f"{name} returns several tensors sized by {self.sym}", "-")
        why = self.rowwise(node, name)
        if why is not None:
            self.block(node, why, _HINTS.get(name, "use a row-wise op on this dimension, or leave it eager"))

    # --- op classes -------------------------------------------------------------------------------------

    def size_read(self, node: fx.Node, name: str) -> None:
        """A size read is fine only when it feeds Dynamo's runtime asserts and nothing else."""
        if node.target is _ASSERT:
            self.flow.asserts.append(node)
            return
        if node.target in _COMPARE or node.target is _SYM_SIZE or name in ("size", "sym_size"):
            if node.users and all(u.target in _COMPARE or u.target is _ASSERT for u in node.users):
                self.flow.asserts.append(node)
                return
        self.block(node, f"{name} reads the number of rows ({self.sym}) as a Python number",
                   "keep the count on the device (e.g. mask.sum()) instead of reading the size")

    def reduction(self, node: fx.Node, name: str) -> None:
        """Rows leave: only a sum-like sink over the padded dim is allowed."""
        if not self.allow_sinks:
            return self.block(node, f"{name} combines the {self.sym} rows", "keep the rows independent")
        base = name.rstrip("_")
        if name in _SINKS:
            self_arg = node.args[0]
            if self.carries.get(self_arg):
                return self.block(node, f"{name} writes into a tensor sized by {self.sym}", "-")
            if base in ("index_add", "scatter_add"):
                dim = _norm_dim(_arg(node, 1, "dim"), example_value(node).dim())
                src_pos, src_name = 3, "source" if base == "index_add" else "src"
                source = _arg(node, src_pos, src_name)
                if dim in self.dims_of(source) and src_name not in node.kwargs:
                    self.flow.sinks.append(Sink(node, src_pos, dim))
                    return
            elif base == "index_put" and _arg(node, 3, "accumulate", False) is True and "values" not in node.kwargs:
                values = _arg(node, 2, "values")
                indices = node.args[1] if len(node.args) > 1 else ()
                if self.dims_of(values)[:1] == (0,) and all(not isinstance(i, fx.Node) or self.dims_of(i) == (0,)
                                                            for i in indices):
                    self.flow.sinks.append(Sink(node, 2, 0))
                    return
            return self.block(node, f"{name} is not a sum over the {self.sym} rows of its source",
                              "accumulate with index_add_ / index_put_(accumulate=True) along the row dimension")
        if base == "sum" and node.args and self.dims_of(node.args[0]) and "input" not in node.kwargs:
            src = node.args[0]
            dims = _arg(node, 1, "dim")
            ndim = example_value(src).dim()
            reduced = set(range(ndim)) if dims is None else {
                _norm_dim(d, ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
            padded = self.dims_of(src)
            if set(padded) <= reduced and len(padded) == 1:
                self.flow.sinks.append(Sink(node, 0, padded[0]))
                return
        if name in ("setitem", "index_put_", "index_put", "index_copy_", "index_copy", "scatter_", "scatter"):
            return self.block(node, f"{name} overwrites rows at data-dependent positions",
                              "accumulate instead (index_add_ / index_put_(accumulate=True))")
        self.block(node, f"{name} combines the {self.sym} rows", _HINTS.get(name, "only a sum over the rows "
                   "(index_add, index_put(accumulate=True), scatter_add, sum) can take padded rows"))

    def rowwise(self, node: fx.Node, name: str) -> Optional[str]:
        """None when `node` (whose output carries the rows) keeps rows independent, else why not."""
        base = name.rstrip("_")
        src = node.args[0] if node.args else None
        if name in _KEEP or base in _MOVE:
            return None
        if name == "getattr" and len(node.args) > 1 and node.args[1] in ("T", "mT", "H", "mH"):
            return None  # x.T: a transpose
        if name in ("expand", "expand_as"):
            return None if self._same_from_end(node, src) else f"{name} repeats rows into new positions"
        if _pointwise(base) or base in ("where", "masked_fill", "clamp", "addcmul", "lerp"):
            if base == "where" and len(node.args) == 1:
                return f"{name} finds positions"
            return None
        if base in _RESHAPE:
            return None if self._same_position(node, src) else f"{name} moves rows into other rows"
        if base in _LINEAR:
            weight_fed = any(self.carries.get(a) for a in node.args[1:] if isinstance(a, fx.Node))
            if weight_fed or example_value(src).dim() - 1 in self.dims_of(src):
                return f"{name} contracts over the {self.sym} rows"
            return None
        if base in _MATMUL or name == "matmul":
            a, b = node.args[0], node.args[1]
            if example_value(a).dim() - 1 in self.dims_of(a):
                return f"{name} contracts over the {self.sym} rows"
            if isinstance(b, fx.Node) and example_value(b).dim() >= 2 and example_value(b).dim() - 2 in self.dims_of(b):
                return f"{name} contracts over the {self.sym} rows"
            return None
        if base in _GATHER:
            return self._gather(node, name)
        if base == "embedding":  # F.embedding(indices, weight): each index row picks table rows
            return f"{name} looks up a table sized by {self.sym}" if self.carries.get(_arg(node, 1, "weight")) \
                else None
        if base == "scaled_dot_product_attention":
            return self._attention(node, name)
        if base == "dropout":  # identity when off; otherwise padded rows would draw random numbers too
            off = _arg(node, 1, "p", 0.5) == 0 or _arg(node, 2, "training", True) is False
            return None if off else f"{name} draws random numbers for the padded rows as well"
        if base == "arange":  # row i is start + i * step: its own index, whatever the row count
            ends_only = node.args[-1:] if len(node.args) <= 2 else node.args[1:2]
            fed = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, fx.Node)
                   and self.sym in _symbols(example_value(a))]
            return None if all(a in ends_only for a in fed) else f"{name}'s start or step depends on {self.sym}"
        if base == "index_copy":
            return self._index_copy(node, name)
        if base in _DIM_OPS:
            return self._dim_op(node, base)
        if base in _LAST_DIMS:
            shape = _arg(node, 1, "normalized_shape")
            ndim = example_value(src).dim()
            count = len(shape) if isinstance(shape, (list, tuple)) else 1
            if any(d >= ndim - count for d in self.dims_of(src)):
                return f"{name} normalizes across the {self.sym} rows"
            return None
        if name in ("getitem",) or isinstance(example_value(src), (tuple, list)):
            return None
        return f"{name} is not known to treat the {self.sym} rows independently"

    def _same_position(self, node: fx.Node, src: Any) -> bool:
        """A reshape keeps rows whole when exactly one dim carries the symbol on each side and the sizes
        before and after it are unchanged ((1, u0, 6) -> (u0, 6) yes; (u0, 6) -> (6, u0) no)."""
        if not isinstance(src, fx.Node):
            return False
        before, after = self.dims_of(src), self.flow.dims.get(node, ())
        if len(before) != 1 or len(after) != 1:
            return False
        ins, outs = _shape(example_value(src)), _shape(example_value(node))
        return (_prod(ins[: before[0]]) == _prod(outs[: after[0]])
                and _prod(ins[before[0] + 1:]) == _prod(outs[after[0] + 1:]))

    def _same_from_end(self, node: fx.Node, src: Any) -> bool:
        """expand only adds leading dims or widens size-1 dims: the row dim keeps its place from the end."""
        if not isinstance(src, fx.Node):
            return False
        before, after = self.dims_of(src), self.flow.dims.get(node, ())
        if not before and len(after) == 1:  # one row (size 1, or a new leading dim) copied to every row
            src_value, offset = example_value(src), example_value(node).dim() - example_value(src).dim()
            return after[0] < offset or src_value.shape[after[0] - offset] == 1
        return (len(before) == len(after) == 1
                and example_value(src).dim() - before[0] == example_value(node).dim() - after[0])

    def _attention(self, node: fx.Node, name: str) -> Optional[str]:
        """Attention is row-wise in its batch dims (all but the last two): the rows may not be keys (dim -2 of
        k, v, the last dim of the mask) nor features (the last dim of q, k, v)."""
        q, k, v = (_arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
        mask = _arg(node, 3, "attn_mask")
        for tensor, last in ((q, 1), (k, 2), (v, 2), (mask, 1)):
            if isinstance(tensor, fx.Node):
                ndim = example_value(tensor).dim()
                if any(d >= ndim - last for d in self.dims_of(tensor)):
                    return f"{name} attends across the {self.sym} rows"
        return None

    def _index_copy(self, node: fx.Node, name: str) -> Optional[str]:
        """`self.index_copy(dim, index, source)` writes every row at the same positions of another dim: row-wise
        when the rows are not `dim`, the index carries none, and source has its rows where self has them."""
        target, index, source = node.args[0], _arg(node, 2, "index"), _arg(node, 3, "source")
        dim = _norm_dim(_arg(node, 1, "dim"), example_value(target).dim())
        rows = self.dims_of(target)
        if dim in rows or self.carries.get(index) or (isinstance(source, fx.Node) and self.dims_of(source) != rows):
            return f"{name} moves the {self.sym} rows to other positions"
        return None

    def _dim_op(self, node: fx.Node, base: str) -> Optional[str]:
        pos, default = _DIM_OPS[base]
        tensors = node.args[0] if base in ("cat", "concat") else [node.args[0]]
        dim = _arg(node, pos, "dim", default)
        if base == "normalize":
            dim = _arg(node, 2, "dim", 1)
        if isinstance(dim, fx.Node) and base in ("max", "min"):
            return None  # the elementwise max(a, b) / min(a, b)
        if dim is None or dim == "required":
            return f"{base} reduces the whole tensor, rows included"
        dims = dim if isinstance(dim, (list, tuple)) else [dim]
        for t in tensors:
            if not isinstance(t, fx.Node):
                continue
            ndim = example_value(t).dim()
            if any(_norm_dim(d, ndim) in self.dims_of(t) for d in dims):
                return f"{base} works across the {self.sym} rows (dim={dim})"
        return None

    def _gather(self, node: fx.Node, name: str) -> Optional[str]:
        """Indexing: a clean tensor gathered by padded indices, or a padded tensor indexed on other dims."""
        src = node.args[0]
        if isinstance(example_value(src), (tuple, list)):
            return None  # picking one result of a multi-output op
        if name.startswith("index_select"):
            dim, index = _arg(node, 1, "dim"), _arg(node, 2, "index")
            src_dims = self.dims_of(src)
            if not src_dims:
                return None  # clean source, padded index: a gather
            if self.carries.get(index) or _norm_dim(dim, example_value(src).dim()) in src_dims:
                return f"{name} picks {self.sym} rows by position"
            return None
        index = node.args[1]
        entries = index if isinstance(index, tuple) else (index,)
        src_dims = self.dims_of(src)
        tensors = [e for e in entries if isinstance(e, fx.Node)]
        if not src_dims:
            return None  # clean source gathered by padded index tensors (in range: padding indexes 0)
        if any(self.carries.get(t) for t in tensors):
            return f"{name} indexes padded rows with padded indices"
        ndim = example_value(src).dim()

        def width(entry: Any) -> int:
            if entry is None:
                return 0
            value = example_value(entry) if isinstance(entry, fx.Node) else None
            return value.dim() if isinstance(value, torch.Tensor) and value.dtype == torch.bool else 1

        explicit = sum(width(e) for e in entries if e is not Ellipsis)
        position = 0
        for entry in entries:
            span = ndim - explicit if entry is Ellipsis else width(entry)
            covered = range(position, position + span)
            if entry is not Ellipsis and any(d in covered for d in src_dims) \
                    and not (isinstance(entry, slice) and entry == slice(None, None, None)):
                return f"{name} selects among the {self.sym} rows by position"
            position += span
        return None


_HINTS = {
    "softmax": "normalize over another dimension, or leave this region eager",
    "mean": "sum the rows (masked) and divide by a device-side count",
    "getitem": "index the rows only with the padded indices, never by position",
}


def row_flow(gm: fx.GraphModule, sym, *, allow_sinks: bool) -> RowFlow:
    """Follow the rows sized by `sym` through `gm` (see the module docstring). `allow_sinks=False` treats every
    reduction of the rows as a blocker (a padded batch must reach the outputs untouched)."""
    return _Walker(gm, sym, allow_sinks).run()

"""A graph input's write done in place again, in the aten graphs the eager inner compiler runs.

aot_autograd hands the inner compiler functional graphs: a module's in-place write to a buffer it reads back (a
KV cache: `cache[:b].index_copy_(2, pos, k)`) becomes an out-of-place op on a view of the buffer, a `*_scatter`
that rebuilds the whole buffer around it, and a `copy_` of the result back into the buffer at the graph's end
(kept in the graph: keep_inference_input_mutations). Run as is, each write copies the whole buffer three times
(the op's fresh result, the scatter, the copy back) where eager wrote the new rows alone: on a GPU, a decode step
of a real model moves its whole cache several times over, inside the graph, on every step. Inductor reinplaces
such writes itself; the eager inner compiler runs the graph it is given, so this pass gives it back the write.

Rewritten (each `copy_(input, new)` at the end of the graph, one write each):
- `new = op(input, ...)` with an in-place variant: `op_(input, ...)`, the copy dropped;
- `new = view_scatter(input, op(view(input, a), ...), a)` (the write through a view): `op_(view(input, a), ...)`,
  the scatter and the copy dropped, later readers of `new` reading `input`.
Only where nothing reads the input, or any view of it, between the write and the graph's end (they would see the
new values early), the result is not a graph output (it would alias an input), and the in-place op keeps the
value's size, stride and dtype (its readers see the input's layout). Anything else stays as aot wrote it.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.fx as fx

from ..passes.common import is_aten_view, same_traced_layout, written_args

__all__ = ["write_inputs_in_place"]

_aten = torch.ops.aten
# a scatter that rebuilds a base around one of its views, and that view
_VIEW_OF_SCATTER = {
    _aten.slice_scatter.default: _aten.slice.Tensor,
    _aten.select_scatter.default: _aten.select.int,
    _aten.diagonal_scatter.default: _aten.diagonal.default,
    _aten.as_strided_scatter.default: _aten.as_strided.default,
}


def write_inputs_in_place(gm: fx.GraphModule) -> int:
    """Rewrite gm's functional writes to its inputs in place (module docstring); how many. Mutates gm."""
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    rewritten = 0
    for copy in [n for n in nodes if n.op == "call_function" and n.target is _aten.copy_.default]:
        target, new = copy.args[0], copy.args[1]
        if target.op != "placeholder" or copy.users or not isinstance(new, fx.Node) or _written_twice(target, copy):
            continue
        if _in_place_at_input(gm, target, new, copy, order) or _in_place_through_view(gm, target, new, copy, order):
            rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _in_place_at_input(gm: fx.GraphModule, target: fx.Node, new: fx.Node, copy: fx.Node,
                       order: Dict[fx.Node, int]) -> bool:
    """new = op(target, ...): op_(target, ...)."""
    in_place = _in_place_variant(new)
    if in_place is None or new.args[0] is not target or not same_traced_layout(new, target) \
            or not _quiet_after(target, new, {new, copy}, order) or _is_output(new):
        return False
    new.target = in_place
    gm.graph.erase_node(copy)
    return True


def _in_place_through_view(gm: fx.GraphModule, target: fx.Node, new: fx.Node, copy: fx.Node,
                           order: Dict[fx.Node, int]) -> bool:
    """new = view_scatter(target, op(view(target, a), ...), a): op_(view(target, a), ...)."""
    view_op = _VIEW_OF_SCATTER.get(new.target)
    if view_op is None or new.args[0] is not target or not isinstance(new.args[1], fx.Node) or _is_output(new):
        return False
    written = new.args[1]
    view = written.args[0] if written.op == "call_function" and written.args else None
    in_place = _in_place_variant(written)
    if in_place is None or not isinstance(view, fx.Node) or view.target is not view_op \
            or view.args[0] is not target or tuple(view.args[1:]) != tuple(new.args[2:]) or view.kwargs != new.kwargs \
            or len(view.users) != 1 or set(written.users) != {new} or not same_traced_layout(written, view) \
            or not same_traced_layout(new, target) or not _quiet_after(target, written, {view, written, new, copy}, order):
        return False
    written.target = in_place
    new.replace_all_uses_with(target, delete_user_cb=lambda user: user is not copy)
    gm.graph.erase_node(copy)
    gm.graph.erase_node(new)
    return True


def _in_place_variant(node: fx.Node) -> Optional[torch._ops.OpOverload]:
    """The in-place overload of node's functional aten op (`index_copy` -> `index_copy_`, same overload), when its
    schema is the functional one's with the first argument written; else None."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or is_aten_view(node):
        return None
    schema = op._schema
    if schema.is_mutable or not schema.arguments or len(schema.returns) != 1:
        return None
    packet = getattr(_aten, schema.name.split("::")[-1] + "_", None)
    in_place = getattr(packet, schema.overload_name or "default", None) if packet is not None else None
    if not isinstance(in_place, torch._ops.OpOverload):
        return None
    arguments = in_place._schema.arguments
    first = arguments[0].alias_info if arguments else None
    if first is None or not first.is_write or len(arguments) != len(schema.arguments) or any(
            a.name != b.name for a, b in zip(arguments[1:], schema.arguments[1:])):
        return None
    return in_place


def _aliases(target: fx.Node) -> List[fx.Node]:
    """target and every node that is a view of it (through aten view ops)."""
    found, frontier = [target], [target]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if is_aten_view(user) and user.args[0] is node:
                found.append(user)
                frontier.append(user)
    return found


def _quiet_after(target: fx.Node, write: fx.Node, allowed: set, order: Dict[fx.Node, int]) -> bool:
    """Does nothing besides `allowed` read `target` or a view of it from `write` on (the values it would see change
    from the old to the new when the write moves there)? Taking a view reads nothing: its readers are checked."""
    at = order[write]
    return all(user in allowed or order[user] < at for alias in _aliases(target) for user in alias.users
               if not is_aten_view(user))


def _written_twice(target: fx.Node, copy: fx.Node) -> bool:
    """Is the input written elsewhere too (another copy_ or in-place op on it or a view of it)?"""
    return any(user is not copy and written_args(user) for alias in _aliases(target) for user in alias.users)


def _is_output(node: fx.Node) -> bool:
    return any(user.op == "output" for user in node.users)

"""Each pass on small functions traced by Dynamo: what it flags, with which category, op, location and module."""

import os

import torch
import torch.nn as nn

from cgcompile.passes import analyze, is_static_placeholder
from cgcompile.passes.common import clean_module_path

HERE = os.path.abspath(__file__)


def graphs_of(fn, *args, dynamic=False, **flags):
    """The FX graphs Dynamo hands a backend for fn(*args)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch._dynamo.config.patch(**flags):
        torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    return graphs


def findings_of(fn, *args, **kw):
    """[(category, op, line, module)] over every graph, in graph order."""
    out = []
    for gm in graphs_of(fn, *args, **kw):
        for node, found in analyze(gm).items():
            f = found[0]
            path, _, line = f.location.rpartition(":")
            assert path == HERE, f.location
            out.append((f.category, f.op, int(line), f.module))
    return out


def line_of(fn, marker):
    """Line number of the source line of fn containing marker (keeps tests robust to edits above them)."""
    import inspect
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def test_item_is_a_host_sync_with_hint():
    def fn(x):
        s = x.sum().item()  # ITEM
        return x * s

    found = findings_of(fn, torch.randn(4), capture_scalar_outputs=True)
    assert found[0][:3] == ("host_sync", "Tensor.item", line_of(fn, "# ITEM"))
    gm = graphs_of(fn, torch.randn(4), capture_scalar_outputs=True)[0]
    item = next(n for n in gm.graph.nodes if n.target == "item")
    assert "0-d tensor" in analyze(gm)[item][0].hint


def test_cpu_copy_and_to_cpu_are_host_syncs():
    def fn(x):
        a = x.cpu()  # CPU
        b = x.to("cpu")  # TO
        c = x.to(torch.float64)  # DTYPE
        return a + 1, b + 1, c

    found = findings_of(fn, torch.randn(4))
    lines = {line for cat, op, line, _ in found if cat == "host_sync"}
    assert lines == {line_of(fn, "# CPU"), line_of(fn, "# TO")}


def test_moves_between_equal_devices_are_not_host_syncs():
    """`.to(x.device)` (RoPE's inv_freq in every HF family) is a no-op on a CPU model as on a GPU model; the plan
    on the CPU is the plan a GPU gets. `.cpu()` and `.to("cpu")` mean "to the host" and stay syncs."""
    def fn(x, freq):
        a = freq.to(x.device)  # SAME
        b = x.to(device=x.device, dtype=torch.float64)  # SAME_KW
        c = x.cpu()  # CPU
        return a * 2, b + 1, c + 1

    found = findings_of(fn, torch.randn(4), torch.randn(4))
    assert {line for cat, _, line, _ in found if cat == "host_sync"} == {line_of(fn, "# CPU")}


def test_data_dependent_output_ops_are_host_syncs():
    # Dynamo breaks the graph at torch.equal (a Python bool); graphs from other tracers can still hold it
    def fn(x):
        return torch.ops.aten.equal.default(x, x)

    gm = torch.fx.symbolic_trace(fn)
    (found,) = analyze(gm).values()
    assert (found[0].category, found[0].op) == ("host_sync", "aten.equal.default")


def test_nonzero_is_the_origin_and_its_consumers_follow():
    def fn(x):
        idx = torch.nonzero(x > 0)  # NONZERO
        y = x[idx.squeeze(1)] * 2  # CONSUMER
        return y.sum() + x.sum()

    found = findings_of(fn, torch.randn(8), capture_dynamic_output_shape_ops=True)
    by_line = {}
    for cat, op, line, _ in found:
        by_line.setdefault(line, set()).add((cat, op))
    assert ("dynamic_shape", "torch.nonzero") in by_line[line_of(fn, "# NONZERO")]
    assert all(cat == "dynamic_shape" for cat, _ in by_line[line_of(fn, "# CONSUMER")])
    # x.sum() has a static shape and is not flagged; y.sum() works on u0 rows and is
    assert ("dynamic_shape", "Tensor.sum") in by_line[line_of(fn, "return y.sum()")]
    assert sum(op == "Tensor.sum" for _, op, _, _ in found) == 1


def test_nonzero_carries_a_fix_hint_and_consumer_names_its_origin():
    def fn(x):
        idx = torch.nonzero(x > 0)
        return x[idx.squeeze(1)]

    (gm,) = graphs_of(fn, torch.randn(8), capture_dynamic_output_shape_ops=True)
    found = analyze(gm)
    origin = next(n for n in gm.graph.nodes if n.target is torch.nonzero)
    assert "nonzero_static" in found[origin][0].hint
    consumer = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "squeeze")
    assert f"from {origin.name}" in found[consumer][0].detail


def test_backed_dynamic_sizes_are_capturable():
    def fn(x):
        return torch.relu(x @ x.t()).sum(0)

    graphs = graphs_of(fn, torch.randn(5, 3), dynamic=True)
    assert any(n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.SymInt)
               for n in graphs[0].graph.nodes), "expected a backed size symbol (s0)"
    assert analyze(graphs[0]) == {}


def test_custom_op_tagged_cudagraph_unsafe():
    @torch.library.custom_op("cgtest::unsafe_add", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
    def unsafe_add(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @unsafe_add.register_fake
    def _(x):
        return torch.empty_like(x)

    def fn(x):
        return unsafe_add(x * 2) * 3  # UNSAFE

    found = findings_of(fn, torch.randn(4))
    assert found == [("cudagraph_unsafe", "cgtest.unsafe_add.default", line_of(fn, "# UNSAFE"), None)]


def test_mutation_of_a_plain_input_is_flagged_but_not_of_a_buffer():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(4))

        def forward(self, x):
            self.count.add_(1)  # BUFFER
            x.mul_(2)  # INPUT
            x[0] = 5.0  # SETITEM
            return x + self.count

    found = findings_of(M(), torch.randn(4))
    assert {(c, line) for c, _, line, _ in found} == {("input_mutation", line_of(M.forward, "# INPUT")),
                                                       ("input_mutation", line_of(M.forward, "# SETITEM"))}


def test_module_path_strips_dynamo_root_whatever_the_parameter_name():
    assert clean_module_path("L['self'].layers[0].attn") == "layers.0.attn"
    assert clean_module_path("L['fn'].layers.1.mlp") == "layers.1.mlp"
    assert clean_module_path("L['s']") == ""
    assert clean_module_path("L['self']._modules['block'].proj") == "block.proj"


def test_findings_carry_the_module_path():
    class Leaf(nn.Module):
        def forward(self, x):
            return torch.nonzero(x)

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.ModuleList([Leaf()])

        def forward(s, x):  # 's' instead of 'self': Dynamo's prefix is L['s']
            return s.inner[0](x)

    found = findings_of(Root(), torch.randn(4), capture_dynamic_output_shape_ops=True)
    assert found[0][0] == "dynamic_shape" and found[0][3] == "inner.0"


def test_parameters_and_buffers_are_static_placeholders():
    model = nn.BatchNorm1d(3)
    (gm,) = graphs_of(model, torch.randn(4, 3))
    static = {n.target for n in gm.graph.nodes if is_static_placeholder(n)}
    plain = {n.target for n in gm.graph.nodes if n.op == "placeholder"} - static
    assert len(plain) == 1
    assert any("running_mean" in t for t in static) and any("weight" in t for t in static)


def test_every_finding_is_made_with_a_reason_member():
    """Categories are spelled once, in cgcompile/reasons.py: no Finding(...) or finding(node, ...) in the package
    passes a bare string as its category (the JSON still holds the member's string value)."""
    import ast
    import pathlib

    from cgcompile.reasons import Finding, Reason

    bare = []
    for path in (pathlib.Path(HERE).parent.parent / "cgcompile").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Finding", "finding"):
                position = 0 if node.func.id == "Finding" else 1
                category = node.args[position] if len(node.args) > position else next(
                    (k.value for k in node.keywords if k.arg == "category"), None)
                member = (isinstance(category, ast.Attribute) and isinstance(category.value, ast.Name)
                          and category.value.id == "Reason")
                passed_on = isinstance(category, ast.Name) and category.id == "category"  # finding()'s own parameter
                if not (member or passed_on):
                    bare.append(f"{path.name}:{node.lineno}")
    assert bare == []
    assert Finding(Reason.HOST_SYNC, "Tensor.item", None, None).to_json()["category"] == "host_sync"

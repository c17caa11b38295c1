"""The plan and the capture guard read one list of sync rules (cgcompile/sync_rules.py): every rule's op, built in a
tiny module, is rejected by the guard and planned eager, so nothing the guard rejects is planned "capture".
Megatron-Core's `masked_target[target_mask] = 0` (a boolean-mask index_put) was the op on which they disagreed:
/work/shared/repros/bool_mask_setitem.py, in both forms, below."""

import inspect
import re

import expecttest
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import cgcompile
from cgcompile.passes import analyze
from cgcompile.runtime.drivers.base import CaptureError
from cgcompile.runtime.drivers.capture_guard import capture_guard
from cgcompile.sync_rules import DEVICE_SYNCS, OP_RULES, TENSOR_READS

OPTIONS = {"driver": "emulate", "cuda_graph_warmup_steps": 1}


@torch.library.custom_op("cgtest_sync_rules::unsafe", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def unsafe(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@unsafe.register_fake
def _(x):
    return torch.empty_like(x)


def data_dependent_output(x):
    return x * torch.ops.aten._local_scalar_dense.default(x.sum())  # SYNC


def cudagraph_unsafe(x):
    return torch.ops.cgtest_sync_rules.unsafe(x)  # SYNC


def dynamic_output_shape(x):
    return torch.nonzero(x > 0).sum() + x  # SYNC


def bool_mask_index_put(x):
    y = x.clone()
    y[x < 0] = torch.zeros(())  # SYNC (the `= 0` form: test_bool_mask_assignment_is_planned_eager)
    return y


def linalg_check_errors(x):
    return torch.linalg.inv(x @ x.T + torch.eye(4))  # SYNC


def histc_without_range(x):
    return torch.histc(x, bins=4).sum() + x  # SYNC


def host_device_copy(x):
    return x.to("cpu") + 1  # SYNC


def tensor_from_python_data(x):
    return x + torch.tensor([1.0, 2.0, 3.0, 4.0])  # SYNC


# one example per rule of OP_RULES; the test below fails when a rule has none
EXAMPLES = {f.__name__: f for f in (data_dependent_output, cudagraph_unsafe, dynamic_output_shape, bool_mask_index_put,
                                    linalg_check_errors, histc_without_range, host_device_copy,
                                    tensor_from_python_data)}
CUDA_ONLY = {"host_device_copy"}  # the guard applies it to CUDA tensors only: the plan's side is checked here
# Python data made a tensor: in eager code a host copy (the guard rejects it), but in a traced graph a constant that
# aot lifts at trace time, so a captured partition never runs the copy: the plan keeps it captured
TRACED_AS_CONSTANT = {"tensor_from_python_data"}
DYNAMO_FLAGS = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}


class Probe(nn.Module):
    """A Linear (something to capture) followed by the op under test."""

    def __init__(self, op):
        super().__init__()
        self.lin, self.op = nn.Linear(4, 4), op

    def forward(self, x):
        return self.op(self.lin(x))


def sync_line(fn) -> str:
    lines, start = inspect.getsourcelines(fn)
    return f"{__file__}:{start + next(i for i, text in enumerate(lines) if '# SYNC' in text)}"


def planned_eager_at(plan, location: str) -> bool:
    """Whether an eager partition holds a finding at `location` (and no captured one does)."""
    kinds = {p.kind for g in plan.graphs for p in g.partitions for f in p.reasons if f.location == location}
    return kinds == {"eager"}


def test_every_op_rule_has_an_example():
    assert sorted(EXAMPLES) == sorted(rule.name for rule in OP_RULES)


@pytest.mark.parametrize("rule", OP_RULES, ids=lambda rule: rule.name)
def test_the_guard_rejects_each_rule_and_the_plan_keeps_it_eager(rule):
    op = EXAMPLES[rule.name]
    model, x = Probe(op), torch.randn(4, 4)
    if rule.name not in CUDA_ONLY:
        with pytest.raises(CaptureError, match=re.escape(rule.detail)):
            with capture_guard(on_cuda=False):
                model(x)
    with torch._dynamo.config.patch(**DYNAMO_FLAGS):
        plan = cgcompile.explain(model, x, options=OPTIONS)
    assert plan.graph_breaks == []
    if rule.name in TRACED_AS_CONSTANT:
        assert not any(p.reasons for g in plan.graphs for p in g.partitions), str(plan)
        torch._dynamo.reset()
        cgcompile.reset_stats()
        compiled = torch.compile(model, backend="cudagraph_modules", options=dict(OPTIONS, cuda_graph_warmup_steps=1))
        for _ in range(4):
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
        st = cgcompile.stats()
        assert st["eager_fallbacks"] == [] and st["steady_replays"] >= 2  # captured, replayed, never rejected
        return
    assert planned_eager_at(plan, sync_line(op)), str(plan)


def index_put_function(x):
    return torch.index_put(x, (x < 0,), torch.zeros(()))  # SYNC


def index_put_method(x):
    return x.clone().index_put_((x < 0,), torch.zeros(()))  # SYNC


def masked_select(x):
    return x.masked_select(x > 0).sum() + x  # SYNC


def inverse(x):
    return (x @ x.T + torch.eye(4)).inverse()  # SYNC


def item(x):
    return x * x.sum().item()  # SYNC


@pytest.mark.parametrize("op", [index_put_function, index_put_method, masked_select, inverse, item],
                         ids=lambda op: op.__name__)
def test_other_forms_of_the_rules_are_planned_eager(op):
    """The same rules reached through other spellings: torch.index_put, Tensor.index_put_, masked_select,
    Tensor.inverse, .item()."""
    with torch._dynamo.config.patch(**DYNAMO_FLAGS):
        plan = cgcompile.explain(Probe(op), torch.randn(4, 4), options=OPTIONS)
    assert planned_eager_at(plan, sync_line(op)), str(plan)


def python_reads_graph(method: str) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_method(method, (x,)))
    return fx.GraphModule(nn.Module(), graph)


@pytest.mark.parametrize("method", sorted(TENSOR_READS))
def test_every_python_level_read_the_guard_patches_is_a_planned_host_sync(method):
    """Dynamo often rewrites these (numpy() into tensor ops, bool() into a break), so the graph is built by hand."""
    gm = python_reads_graph(method)
    [(node, found)] = analyze(gm).items()
    assert node.target == method and found[0].category == "host_sync"
    with pytest.raises(CaptureError, match="reads device memory on the host"):
        with capture_guard(on_cuda=False):
            getattr(torch.ones(()), method)()


@pytest.mark.parametrize("owner,name,what", DEVICE_SYNCS, ids=[what for _, _, what in DEVICE_SYNCS])
def test_every_device_wait_the_guard_patches_is_a_planned_host_sync(owner, name, what):
    graph = fx.Graph()
    if owner is torch.cuda:
        graph.call_function(getattr(owner, name))
    else:
        graph.call_method(name, (graph.placeholder("stream"),))
    graph.output(None)
    [(_, found)] = analyze(fx.GraphModule(nn.Module(), graph)).items()
    assert found[0].category == "host_sync" and what in found[0].detail


def test_masked_scatter_is_no_sync_for_either_side():
    """`masked_scatter` (forward and backward) finds its positions on the device: planned capture, captured."""
    class Scatter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return x.masked_scatter(x > 0, self.lin(x)).sum()

    torch._dynamo.reset()
    cgcompile.reset_stats()
    model, x = Scatter(), torch.randn(4, 4)
    plan = cgcompile.explain(model, x, options=OPTIONS)
    assert [p.kind for g in plan.graphs for p in g.partitions] == ["capture"]
    compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    for _ in range(3):
        compiled(x).backward()
    stats = cgcompile.stats()
    assert stats["eager_fallbacks"] == [] and stats["graphs_captured"] == 2
    cgcompile.release()


class MaskedGather(torch.autograd.Function):
    """What Megatron-Core's vocab-parallel cross entropy does inside its autograd.Function."""

    @staticmethod
    def forward(ctx, x, t):
        t2 = t.clone()
        t2[t < 0] = 0  # MASKED (in the Function)
        ctx.save_for_backward(t2)
        ctx.shape = x.shape
        return x.gather(-1, t2.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, g):
        (t2,) = ctx.saved_tensors
        return torch.zeros(ctx.shape, dtype=g.dtype).scatter(-1, t2.unsqueeze(-1), g.unsqueeze(-1)), None


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, t):
        h = self.l2(self.l1(x).relu())
        t2 = t.clone()
        t2[t < 0] = 0  # MASKED (plain)
        return h.gather(-1, t2.unsqueeze(-1)).sum()


class InFunction(Plain):
    def forward(self, x, t):
        return MaskedGather.apply(self.l2(self.l1(x).relu()), t).sum()


@pytest.mark.parametrize("cls,marker", [(Plain, "# MASKED (plain)"), (InFunction, "# MASKED (in the Function)")],
                         ids=["plain", "autograd_function"])
def test_bool_mask_assignment_is_planned_eager_and_falls_back_nowhere(cls, marker):
    """The repro of issue #41 (Megatron-Core's `masked_target[target_mask] = 0`), as a module and in an
    autograd.Function: the assignment is planned eager, the rest captures, and training replays without fallback."""
    torch._dynamo.reset()
    cgcompile.release()
    cgcompile.reset_stats()
    model, x, t = cls(), torch.randn(4, 8), torch.tensor([1, -1, 3, 2])
    source, line = inspect.getsourcelines(cls.forward if cls is Plain else MaskedGather.forward)
    location = f"{__file__}:{line + next(i for i, text in enumerate(source) if marker in text)}"
    plan = cgcompile.explain(model, x, t, options=OPTIONS)
    assert planned_eager_at(plan, location), str(plan)
    [finding] = [f for g in plan.graphs for p in g.partitions for f in p.reasons if f.location == location]
    assert (finding.category, finding.op) == ("host_sync", "operator.setitem")
    assert "boolean mask" in finding.detail and "masked_fill_" in finding.hint
    assert "capture" in [p.kind for g in plan.graphs for p in g.partitions]
    reference = cls()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    for _ in range(4):
        compiled(x, t).backward()
        reference(x, t).backward()
    stats = cgcompile.stats()
    assert stats["eager_fallbacks"] == [] and stats["steady_replays"] > 0
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)
    cgcompile.release()


class TestPinnedWording(expecttest.TestCase):
    def test_bool_mask_assignment_in_the_plan(self):
        torch._dynamo.reset()
        plan = cgcompile.explain(InFunction(), torch.randn(4, 8), torch.tensor([1, -1, 3, 2]), options=OPTIONS)
        [finding] = [f for g in plan.graphs for p in g.partitions for f in p.reasons]
        table = "\n".join(str(plan).splitlines()[2:])
        self.assertExpectedInline(f"{table}\n{finding.detail}\nfix: {finding.hint}", """\
id  kind     tags  module  ops  first reason
 0  capture  -     -         3  -
 1  eager    -     -         2  host_sync: operator.setitem at test_sync_rules.py:218
aten.index_put_ with a boolean mask finds the masked positions on the host
fix: write through the mask on the device: t.masked_fill_(mask, value) or torch.where(mask, value, t)""")

"""Exactness across partition boundaries: global state (grad mode, functorch levels) never leaks out of a
partition, capture and warmup leave the random generators alone, and op tags come from the overload called.

Each pattern is a minimal model of something real models do; each trains through the backend (emulate driver)
exactly like eager, with graphs captured and replayed, and leaves the thread's state as eager leaves it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._higher_order_ops.associative_scan import associative_scan

import cgcompile
from cgcompile.backend import record_plans
from cgcompile.runtime.drivers.thread_state import GlobalState

D = 8
OPTIONS = {"driver": "emulate", "cuda_graph_warmup_steps": 1, "min_partition_ops": 1}


class Stats(nn.Module):
    """A reshape of its input, then a no_grad block whose statistics go through an eager island (`.item()`),
    then differentiable work on the reshaped input: the partition before the island returns a view of its
    input (aot re-creates such views after the graph, in whatever grad mode is current) and ends in the block."""

    def __init__(self):
        super().__init__()
        self.b = nn.Linear(D, D)

    def forward(self, x):
        h = x.reshape(-1, D)
        with torch.no_grad():
            positive = (h > 0).sum().item()
            scale = h.abs().mean() + positive
        return self.b(torch.relu(h)) * scale


class NoGradStats(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, D), Stats()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


class Scan(nn.Module):
    """A state-space style recurrence through associative_scan(combine_mode="generic"), which Dynamo records as
    vmap level push/pop nodes (the pop has no module stack)."""

    def __init__(self):
        super().__init__()
        self.gate, self.out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        decay = torch.sigmoid(self.gate(x))
        return self.out(associative_scan(lambda p, q: p * q, decay, dim=1, combine_mode="generic"))


class ScanStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Scan(), Scan()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.sum()


class NoisyRouter(nn.Module):
    """A router that adds exponential (Gumbel-style) noise in training, then dropout: every call draws."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(D, D), nn.Linear(D, D)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        logits = self.proj(x)
        noise = torch.empty_like(logits).exponential_()
        weights = torch.softmax(logits - noise.log(), dim=-1)
        return self.out(self.drop(weights * x)).sum()


class Repeat(nn.Module):
    """repeat_interleave with a static result size: an int repeat, and a tensor repeat given output_size."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x).repeat_interleave(2, dim=0)
        counts = torch.full((h.shape[0],), 2, dtype=torch.long)
        h = torch.repeat_interleave(h, counts, dim=0, output_size=2 * h.shape[0])
        return self.b(h).sum()


def train_both(model_cls, inputs, steps=4, options=None):
    """Train `model_cls` compiled and eager side by side from the same weights and seeds; return the plans.
    Losses and every gradient must be equal, and after each compiled call the thread's state must be eager's."""
    torch.manual_seed(0)
    model = model_cls()
    reference = model_cls()
    reference.load_state_dict(model.state_dict())
    cgcompile.reset_stats()
    with record_plans() as rec:
        compiled = torch.compile(model, backend="cudagraph_modules", options={**OPTIONS, **(options or {})})
        for step in range(steps):
            x = inputs(step)
            torch.manual_seed(100 + step)
            loss = compiled(x)
            state_after_compiled = GlobalState.now()
            torch.manual_seed(100 + step)
            expected = reference(x)
            assert state_after_compiled == GlobalState.now()
            loss.backward()
            expected.backward()
            torch.testing.assert_close(loss, expected, rtol=0, atol=0)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert p.grad is not None, f"{name}: no gradient at step {step}"
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
            model.zero_grad()
            reference.zero_grad()
    stats = cgcompile.stats()
    assert stats["graphs_captured"] > 0 and stats["steady_replays"] > 0, stats
    assert stats["eager_fallbacks"] == [], stats["eager_fallbacks"]
    return rec.graphs


def assert_islands_explained(graphs):
    """Every eager partition says why, with the user's file:line."""
    for graph in graphs:
        for partition in graph.partitions:
            if not partition.captured:
                assert partition.reasons and all(r.location for r in partition.reasons), partition


@pytest.fixture
def scalar_outputs():
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        yield


def test_no_grad_block_ending_a_partition_keeps_gradients(scalar_outputs):
    graphs = train_both(NoGradStats, lambda step: torch.randn(4, D))
    assert_islands_explained(graphs)
    (graph,) = graphs
    # the block is entered and left around its island: the grad-mode switches are no islands of their own
    eager = [p for p in graph.partitions if not p.captured]
    assert {r.category for p in eager for r in p.reasons} == {"host_sync", "dynamic_shape"}  # .item(), its use
    for partition in graph.partitions:
        assert not all(name.startswith("_set_grad_enabled") for name in partition.nodes), partition.nodes
    assert any(p.captured for p in graph.partitions)


def test_vmap_level_stays_in_one_partition():
    cgcompile.tag("mamba")(Scan)
    try:
        graphs = train_both(ScanStack, lambda step: torch.randn(2, 5, D), options={"cuda_graph_modules": ["mamba"]})
    finally:
        cgcompile.untag(Scan)
    assert_islands_explained(graphs)
    (graph,) = graphs
    for partition in graph.partitions:
        pushes = sum(n.startswith("_vmap_increment_nesting") for n in partition.nodes)
        pops = sum(n.startswith("_vmap_decrement_nesting") for n in partition.nodes)
        assert pushes == pops, partition.nodes
    assert [p.tags for p in graph.partitions if p.captured] == [("mamba",), ("mamba",)]


def test_capture_draws_no_random_numbers():
    train_both(NoisyRouter, lambda step: torch.randn(4, D), steps=5)


def test_verify_mode_compares_the_same_draws():
    train_both(NoisyRouter, lambda step: torch.randn(4, D), steps=4, options={"verify": 3})
    assert max(cgcompile.stats()["verify_max_diff"].values()) == 0.0


def test_static_repeat_interleave_is_captured():
    graphs = train_both(Repeat, lambda step: torch.randn(3, D))
    (graph,) = graphs
    assert all(p.captured for p in graph.partitions), [p.reasons for p in graph.partitions]


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_data_dependent_repeat_interleave_stays_eager():

    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, D)

        def forward(self, x, counts):
            return self.a(torch.repeat_interleave(x, counts, dim=0)).sum()

    plan = cgcompile.explain(Counts(), torch.randn(3, D), torch.tensor([1, 2, 3]), options=OPTIONS)
    findings = [r for g in plan.graphs for p in g.partitions for r in p.reasons]
    assert [(f.category, f.op) for f in findings][:1] == [("dynamic_shape", "torch.repeat_interleave")]


def test_every_partition_leaves_grad_mode_as_it_found_it(scalar_outputs):
    from cgcompile.frame_plan import make_plan
    from cgcompile.config import CudaGraphConfig
    from cgcompile.split import split
    from cgcompile.passes.state_switches import grad_mode_after

    graphs = []
    torch.compile(NoGradStats(), backend=lambda gm, example: (graphs.append((gm, example)), gm.forward)[1])(
        torch.randn(4, D))
    (gm, example), = graphs
    plan = make_plan(gm, example, CudaGraphConfig.from_options(OPTIONS), 0)
    split_gm = split(gm, plan)
    submodules = [m for name, m in split_gm.named_children() if name.startswith("submod_")]
    assert len(submodules) == len(plan.partitions) > 2
    for submod in submodules:
        output = next(n for n in reversed(submod.graph.nodes) if n.op == "output")
        assert grad_mode_after(submod, True)[output] is True, submod.code

"""Graphs that are reused, not just captured (issue 27), on the loops that used to defeat reuse: an eager island's
autograd context keeping a partition output, a graph break in every layer, sizes that cycle under a small cap,
declared capture sizes; and the per-layer policy state (warmup per parameter set, graphs of freed parameters
released at once, a deleted model's when the next frame compiles). "Reuse" counts steady replays: a graph run
again after the call that captured it."""

from __future__ import annotations

import copy
import gc
import sys

import pytest
import torch
import torch.nn as nn

import cgcompile
from cgcompile.runtime import live_runtimes


@pytest.fixture(autouse=True)
def _no_graphs_from_earlier_tests():
    """stats()["graphs"] lists every live graph of the process: start from none."""
    torch._dynamo.reset()  # releases every graph through the backend's reset hook
    cgcompile.release()
    yield


def _steady(stats) -> int:
    return stats["steady_replays"]


def _calls(stats) -> int:
    return sum(p["calls"] for p in stats["partitions"])


# --- an island's autograd context keeps a partition output ------------------------------------------------------


@torch.library.custom_op("cgtest::keeps_offs", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def keeps_offs(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Like transformers' grouped-mm fallback: reads its offsets on the host, keeps them on its autograd context."""
    return x * float(offs.sum() > -1e30)


keeps_offs.register_fake(lambda x, offs: torch.empty_like(x))


def _setup(ctx, inputs, output):
    ctx.offs = inputs[1]  # an attribute, not a saved tensor: lives as long as the autograd graph


keeps_offs.register_autograd(lambda ctx, g: (g, None), setup_context=_setup)


class IslandModel(nn.Module):
    island = staticmethod(keeps_offs)

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = torch.relu(self.a(x))
        offs = torch.tensor([x.shape[0] // 2, x.shape[0]]) + (h.sum() * 0).long()  # computed in a partition
        return self.b(torch.relu(self.island(h, offs))).pow(2).mean()


def _train_island(model: nn.Module, warmup: int, keep: bool, steps: int = 8):
    """SGD steps of `model` compiled and of an eager copy, losses and parameters exactly equal; steady replays
    after each step, and stats(). `keep`: the loss lives until the next step's forward has run."""
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "cuda_graph_warmup_steps": warmup})
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, reference)]
    cgcompile.reset_stats()
    steady = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for net, opt in ((compiled, opts[0]), (reference, opts[1])):
            opt.zero_grad()
            loss = net(x)
            loss.backward()
            opt.step()
            if net is compiled:
                got = loss.detach()
            else:
                torch.testing.assert_close(got, loss.detach(), rtol=0, atol=0)
            if not keep:
                del loss
        steady.append(_steady(cgcompile.stats()))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    return steady, cgcompile.stats()


@pytest.mark.parametrize("keep", [True, False], ids=["loss_kept", "loss_deleted"])
def test_an_output_kept_by_an_islands_context_is_copied_and_the_graphs_reused(keep):
    torch.manual_seed(0)
    steady, st = _train_island(IslandModel(), warmup=1, keep=keep)
    assert st["graphs_captured"] == len(st["graphs"]) == 4  # two partitions, forward and backward
    assert all(b > a for a, b in zip(steady[2:], steady[3:]))  # every step after the capture step replays
    assert st["graphs_released"] == 0 and st["eager_fallbacks"] == [] and st["bank_stops"] == []


@torch.library.custom_op("cgtest::keeps_offs_in_a_cycle", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def keeps_offs_in_a_cycle(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x * float(offs.sum() > -1e30)


keeps_offs_in_a_cycle.register_fake(lambda x, offs: torch.empty_like(x))


def _setup_cycle(ctx, inputs, output):
    ctx.offs = inputs[1]
    ctx.me = ctx  # a reference cycle: the context outlives its step until the cyclic collector runs


keeps_offs_in_a_cycle.register_autograd(lambda ctx, g: (g, None), setup_context=_setup_cycle)


class CycleIslandModel(IslandModel):
    island = staticmethod(keeps_offs_in_a_cycle)


def test_a_graph_held_only_by_garbage_in_a_reference_cycle_is_freed_not_doubled(monkeypatch):
    """Without warmup the capture call hands the island the graph's own offs, and the island's context keeps them
    in a reference cycle: garbage once the step is done, but holding the graph until Python's cyclic collector
    runs (with objects promoted to the oldest generation, many steps later: here never, the collector is off).
    The runtime collects before it takes a graph for held, so the loop keeps its 4 graphs and replays them: not
    a second instance of every graph (8 before), whose count would depend on when the collector last ran. What the
    garbage held is handed out as a copy from then on, so one collection serves the whole run (7 without)."""
    import gc
    import types

    from cgcompile.runtime.memory import garbage

    collections = []
    monkeypatch.setattr(garbage, "gc", types.SimpleNamespace(collect=lambda: collections.append(gc.collect())))
    torch.manual_seed(0)
    gc.collect()
    gc.disable()
    try:
        steady, st = _train_island(CycleIslandModel(), warmup=0, keep=False)
    finally:
        gc.enable()
    assert len(st["graphs"]) == 4 and st["eager_fallbacks"] == [], [g["label"] for g in st["graphs"]]
    assert steady[-1] - steady[2] >= 5 * 4  # every graph replayed at every later step
    assert len(collections) == 1


# --- a graph break in every layer ------------------------------------------------------------------------------


class BreakBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        x = x + torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return x + torch.relu(self.b(x))


def _train_with_breaks(layers: int, steps: int, warmup: int = 3):
    torch.manual_seed(0)
    model = nn.Sequential(*[BreakBlock() for _ in range(layers)])
    compiled = torch.compile(model, backend="cudagraph_modules", options={"driver": "emulate"})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    cgcompile.reset_stats()
    marks = []
    for step in range(steps):
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        marks.append((_steady(cgcompile.stats()), _calls(cgcompile.stats())))
    return marks, cgcompile.stats()


@pytest.mark.parametrize("layers", [8, 16, 48])
def test_a_break_per_layer_captures_each_layers_graphs_once_and_reuses_them(layers):
    warmup = 3
    marks, st = _train_with_breaks(layers, steps=warmup + 3)
    assert st["graphs_captured"] == len(st["graphs"]) == 4 * layers  # two partitions per layer, fwd and bwd
    assert st["graphs_released"] == 0 and st["bank_stops"] == [] and st["eager_fallbacks"] == []
    # after the capture step, every forward/inference call of every layer replays a graph captured earlier
    (steady_0, calls_0), (steady_1, calls_1) = marks[warmup], marks[-1]
    forward_steady = sum(p["replays"] for p in st["partitions"])
    assert forward_steady == calls_1 - (warmup + 1) * 2 * layers  # warmup and capture calls only missed
    assert steady_1 - steady_0 >= 0.95 * 2 * (calls_1 - calls_0)  # forward and backward replays, all steady
    assert sum(row["warmup_calls"] for row in st["partitions"]) == warmup * 2 * layers  # each layer on its own


def test_host_work_per_replay_does_not_grow_with_depth():
    """Python calls into cgcompile's runtime per forward partition call, counted on steady steps: the same at 48
    layers as at 8 (instances found per layer, the pool rule incremental, sweeps per layer)."""
    runtime_dir = cgcompile.runtime.__file__.rsplit("/", 1)[0]

    def calls_per_forward_call(layers: int) -> float:
        torch.manual_seed(0)
        model = nn.Sequential(*[BreakBlock() for _ in range(layers)])
        compiled = torch.compile(model, backend="cudagraph_modules", options={"driver": "emulate"})
        x = torch.randn(4, 32)
        for _ in range(5):
            compiled(x).sum().backward()
        counted = [0]

        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(runtime_dir) and \
                    "emulate_driver" not in frame.f_code.co_filename:
                counted[0] += 1

        before = _calls(cgcompile.stats())
        sys.setprofile(profile)
        try:
            for _ in range(2):
                compiled(x).sum().backward()
        finally:
            sys.setprofile(None)
        return counted[0] / (_calls(cgcompile.stats()) - before)

    shallow, deep = calls_per_forward_call(8), calls_per_forward_call(48)
    assert deep <= shallow * 1.05, (shallow, deep)


# --- sizes: a small cap, declared capture sizes ----------------------------------------------------------------


def test_a_cap_with_cycling_sizes_captures_up_to_the_cap_and_replays_those():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6))
    compiled = torch.compile(model, backend="cudagraph_modules", dynamic=True, options={
        "driver": "emulate", "cuda_graph_warmup_steps": 1, "max_graphs_per_partition": 2})
    cgcompile.reset_stats()
    for bs in [2, 3, 4, 5] * 5:
        torch.testing.assert_close(compiled(torch.ones(bs, 6)), model(torch.ones(bs, 6)), rtol=0, atol=0)
    st = cgcompile.stats()
    assert st["graphs_captured"] == len(st["graphs"]) == 2 and st["bank_stops"] == []
    assert all(g["steady_replays"] == 3 for g in st["graphs"])  # captured in round 2, replayed in rounds 3 to 5


DECLARED_SIZES_BATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 3, 5, 1, 7)


def declared_sizes_model():
    """(model, compiled): an MLP served with capture_sizes=[2, 4, 8] (also bench_cpu's table (g))."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    return model, torch.compile(model, backend="cudagraph_modules", dynamic=True, options={
        "driver": "emulate", "inference_cuda_graph_scope": "block", "cuda_graph_warmup_steps": 1,
        "capture_sizes": [2, 4, 8]})


def test_declared_capture_sizes_are_captured_once_each():
    model, compiled = declared_sizes_model()
    cgcompile.reset_stats()
    with torch.no_grad():
        for bs in DECLARED_SIZES_BATCHES:
            x = torch.randn(bs, 8, generator=torch.Generator().manual_seed(bs))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-6, atol=1e-6)
    st = cgcompile.stats()
    assert st["graphs_captured"] == 3 and st["graphs_released"] == 0  # the arena was sized for 8 at once
    by_partition = {}  # (a batch of 1 is another Dynamo frame: one partition each)
    for g in st["graphs"]:
        by_partition.setdefault(g["partition"], set()).add(g["arena"])
    assert all(len(arenas) == 1 for arenas in by_partition.values())


# --- per-layer policy state ------------------------------------------------------------------------------------


def test_a_frame_shared_by_layers_warms_up_each_layer_before_capturing_it():
    warmup = 2
    torch.manual_seed(0)
    model = nn.Sequential(*[BreakBlock() for _ in range(3)])
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "cuda_graph_warmup_steps": warmup})
    cgcompile.reset_stats()
    captured = []
    for _ in range(warmup + 2):
        compiled(torch.randn(4, 32)).sum().backward()
        captured.append(cgcompile.stats()["graphs_captured"])
    assert captured == [0, 0, 12, 12]  # nothing before each layer's own warmup ends; then every layer at once


def test_graphs_of_parameters_that_were_freed_are_released_at_the_next_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "cuda_graph_warmup_steps": 1})
    for _ in range(3):
        compiled(torch.randn(2, 8)).sum().backward()
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new parameter objects: the old graphs read freed parameters
    cgcompile.reset_stats()
    for _ in range(3):
        x = torch.randn(2, 8)
        out = compiled(x)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
        out.sum().backward()
    st = cgcompile.stats()
    assert st["graphs_released"] == 1  # the old forward instance, with its backward, at the first call
    assert len(st["graphs"]) == 2 and all(g["steady_replays"] >= 1 for g in st["graphs"])
    assert sum(len(rt.live_graphs()) for rt in live_runtimes()) == 2


def test_a_deleted_models_graphs_are_released_when_the_next_frame_compiles():
    """A sweep over model widths in one process: each width is a frame of its own, never called again once its
    model is gone; its graphs go when the next model's frame compiles, not at the end of the run."""
    options = {"cuda_graph_modules": [], "driver": "emulate", "cuda_graph_warmup_steps": 1}
    cgcompile.reset_stats()
    trials = []
    for width in (32, 48, 64):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 4))
        compiled = torch.compile(model, backend="cudagraph_modules", options=options)
        for _ in range(4):
            compiled(torch.randn(4, 16)).sum().backward()
        trials.append([g for rt in live_runtimes() for g in rt.live_graphs() if not any(
            g is kept for graphs in trials for kept in graphs)])
        assert [g.kind for g in trials[-1]] == ["forward", "backward"] and trials[-1][0].replays > 1
        del model, compiled
        gc.collect()
    assert [all(g.alive for g in graphs) for graphs in trials] == [False, False, True]
    assert cgcompile.stats()["graphs_released"] == 2  # each forward instance, with its backward

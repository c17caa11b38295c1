"""Output arenas (cgcompile/runtime/memory/arena.py): graphs of one partition captured for different input sizes share
their outputs' memory, on the emulate driver (real shared CPU memory: a graph that wrote over another size's
outputs still in use would give wrong numbers here, as on a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import cgcompile
from cgcompile.runtime.memory.arena import arena_capacity, output_layouts, span_bytes, superseded
from tests.models import MODELS
from tests.parity import assert_step_matches_eager

OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": [], "driver": "emulate", "cuda_graph_warmup_steps": 1,
           "inner_compiler": "eager"}  # the default auto's choice off CUDA: the GPU twins (tests/gpu) run it too


def mlp(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).to(device)


def compiled(model: nn.Module, **options) -> nn.Module:
    torch._dynamo.reset()
    cgcompile.reset_stats()
    return torch.compile(model, backend="cudagraph_modules", options={**OPTIONS, **options})


def batch(rows: int, seed: int, device: str = "cpu") -> torch.Tensor:
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed)).to(device)
    torch._dynamo.mark_dynamic(x, 0)
    return x


def groups(rows):
    """arena name -> the rows of the live graphs writing into it."""
    found = {}
    for row in rows:
        if row["arena"]:
            found.setdefault(row["arena"], []).append(row)
    return found


# --- pure rules ---------------------------------------------------------------------------------------------------


def test_arena_capacity_serves_every_size_seen():
    assert arena_capacity({0: 100, 1: 8}, {}) == {0: 100, 1: 8}
    assert arena_capacity({0: 100}, {0: 300, 1: 8}) == {0: 300, 1: 8}
    assert arena_capacity({0: 500, 1: 4}, {0: 300, 1: 8}) == {0: 500, 1: 8}


def test_superseded_names_arenas_smaller_than_the_largest_somewhere():
    assert superseded([{0: 100}, {0: 300}]) == [0]
    assert superseded([{0: 300, 1: 8}, {0: 300, 1: 8}]) == []  # two full-size arenas: graphs in flight together
    assert superseded([{0: 300, 1: 4}, {0: 200, 1: 8}, {0: 300, 1: 8}]) == [0, 1]


def test_output_layouts_move_only_fresh_unshared_memory():
    x = torch.randn(4, 3)
    fresh = torch.randn(2, 5).t()  # strided: its layout is kept
    shared = torch.randn(6)
    outputs = [fresh, x[1:], shared[:3], shared[3:], torch.empty(0), 3, None]
    layouts = output_layouts(outputs, [x], torch.device("cpu"))
    assert layouts[0] == (torch.float32, (5, 2), (1, 5), span_bytes(fresh)) and span_bytes(fresh) == 40
    assert layouts[1:] == [None] * 6  # a view of an input, two outputs on one storage, empty, non-tensors
    assert output_layouts([fresh], [], torch.device("meta")) == [None]  # another device stays put


# --- end to end ---------------------------------------------------------------------------------------------------


def test_sizes_share_one_arena_per_graph_kind_and_train_like_eager():
    check_sizes_share_one_arena(device="cpu", driver="emulate")


def trained_pair(device: str, driver: str):
    """(model, its eager copy, the model compiled on `driver`)."""
    model = mlp(device)
    return model, copy.deepcopy(model), compiled(model, driver=driver)


def check_sizes_share_one_arena(device: str, driver: str) -> None:
    """Also run on CUDA (tests/gpu/test_gpu_arena.py)."""
    model, reference, run = trained_pair(device, driver)
    sizes = [4, 6, 4, 6, 5, 4, 5, 6, 4, 5, 6]
    for i, rows in enumerate(sizes):
        x = batch(rows, i, device)
        out, ref = run(x), reference(x)
        out.square().sum().backward()
        ref.square().sum().backward()
        exact = 0 if device == "cpu" else 1e-5  # CUDA: cuBLAS may pick another kernel under capture
        torch.testing.assert_close(out, ref, rtol=exact, atol=exact)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    st = cgcompile.stats()
    arenas = groups(st["graphs"])
    kinds = sorted({row["kind"] for members in arenas.values() for row in members})
    assert kinds == ["backward", "forward"] and len(arenas) == 2  # one arena per kind for all three sizes
    for members in arenas.values():
        assert len(members) == 3 and all(row["replays"] > 1 for row in members)
        arena_bytes = members[0]["arena_bytes"]
        spans = [row["arena_output_bytes"] for row in members]
        assert max(spans) <= arena_bytes < sum(spans)  # the largest size's outputs, not one copy per size
        assert all(row["static_output_bytes"] == 0 for row in members)
    own = sum(r["pool_bytes"] + r["static_input_bytes"] + r["static_output_bytes"] for r in st["graphs"])
    assert st["graph_bytes"] == own + sum(members[0]["arena_bytes"] for members in arenas.values())


def test_grads_kept_as_grad_into_the_next_forward_are_learnt_with_arenas():
    """A loop that clears the grads between the forward and the backward (forward, zero_grad, backward, step) keeps
    every .grad into the next forward. A backward graph writing an output arena handed its grads out as aliases
    AccumulateGrad kept as .grad, so its arena was held at every next forward and no lesson was learnt: each call
    captured another instance (here 8 in 24 steps, 16 graphs; a 4-layer model whose epoch's smaller last batch made
    the sizes dynamic captured 48 graphs in 12 steps and replayed none). Now the held arena teaches that the grads
    are kept: copied from then on, 3 instances (one a size held a step longer needed), and every call of the last
    epochs replays."""
    model, reference, run = trained_pair("cpu", "emulate")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    replays = []
    for epoch in range(8):
        for i, rows in enumerate([4, 4, 3]):
            x = batch(rows, epoch * 3 + i)
            for fn, optimizer in ((run, opt), (reference, ref_opt)):
                loss = fn(x).square().sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p, q, rtol=0, atol=0)
        replays.append(sum(p["replays"] for p in cgcompile.stats()["partitions"]))
    assert [b - a for a, b in zip(replays[-4:], replays[-3:])] == [3, 3, 3], replays  # each call of an epoch
    assert max(p["captures"] for p in cgcompile.stats()["partitions"]) <= 3


def test_a_larger_size_moves_the_smaller_sizes_into_its_arena():
    run = compiled(mlp())
    for i, rows in enumerate([4, 4, 4, 6, 6, 4, 4, 6]):
        run(batch(rows, i)).sum().backward()
    st = cgcompile.stats()
    arenas = groups(st["graphs"])
    assert len(arenas) == 2 and all(len(members) == 2 for members in arenas.values())
    # size 4's forward graph (with its backward) was released when size 6 was captured, and captured again
    assert st["graphs_released"] == 1
    (row,) = st["partitions"]
    assert row["captures"] == 3 and row["releases"] == 1


def test_graphs_in_flight_together_get_separate_arenas():
    check_graphs_in_flight_get_separate_arenas(device="cpu", driver="emulate")


def check_graphs_in_flight_get_separate_arenas(device: str, driver: str) -> None:
    """fwd(4), fwd(6), bwd, bwd: the second size must not write over the first's saved activations."""
    model, reference, run = trained_pair(device, driver)
    for step in range(4):
        xs = [batch(4, 10 * step, device), batch(6, 10 * step + 1, device)]
        losses = [run(x).square().sum() for x in xs]
        refs = [reference(x.detach().clone()).square().sum() for x in xs]
        (losses[0] + losses[1]).backward()
        (refs[0] + refs[1]).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    st = cgcompile.stats()
    forward = [row for row in st["graphs"] if row["kind"] == "forward"]
    assert len(forward) == 2 and min(row["replays"] for row in forward) > 1
    assert len({row["arena"] for row in forward}) == 2  # both sizes live at once: one arena each


def test_outputs_kept_by_the_caller_are_not_overwritten_by_another_size():
    check_kept_outputs_survive_another_size(device="cpu", driver="emulate")


def check_kept_outputs_survive_another_size(device: str, driver: str) -> None:
    model = mlp(device)
    run = compiled(model, clone_outputs=False, driver=driver)
    with torch.no_grad():
        for i in range(3):  # warm up and capture both sizes
            run(batch(4, i, device))
            run(batch(6, i, device))
        x4, x6 = batch(4, 7, device), batch(6, 8, device)
        kept = run(x4)
        expected = model(x4)
        other = run(x6)  # its arena holds `kept`: this call must not write there
        exact = 0 if device == "cpu" else 1e-5
        torch.testing.assert_close(kept, expected, rtol=exact, atol=exact)
        torch.testing.assert_close(other, model(x6), rtol=exact, atol=exact)
    inference = [row for row in cgcompile.stats()["graphs"] if row["kind"] == "inference"]
    assert len({row["arena"] for row in inference}) == 2


def test_static_sizes_keep_their_own_outputs():
    """A partition traced with fixed sizes writes no arena and copies nothing (the common dense path)."""
    run = compiled(mlp())
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(3):
        run(x).sum().backward()
    rows = cgcompile.stats()["graphs"]
    assert rows and all(row["arena"] is None and row["static_output_bytes"] > 0 for row in rows)


@pytest.mark.parametrize("spec_name", ["dense_gpt"])
def test_dynamic_sequence_lengths_match_eager_with_arenas(spec_name):
    spec = MODELS[spec_name]
    model = spec.make()
    reference = copy.deepcopy(model)
    options = spec.options(driver="emulate", cuda_graph_warmup_steps=1)
    torch._dynamo.reset()
    cgcompile.reset_stats()
    run = torch.compile(model, backend="cudagraph_modules", options=options, dynamic=True)
    for i, seq in enumerate([8, 6, 8, 6, 5, 8, 6, 5, 7, 8]):
        (tokens,) = spec.example_inputs(seq=seq, seed=i)
        assert_step_matches_eager(spec, run, model, reference, tokens)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    st = cgcompile.stats()
    assert st["steady_replays"] > 0 and st["eager_fallbacks"] == []
    assert groups(st["graphs"])  # the layers' graphs share arenas across lengths

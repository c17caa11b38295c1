"""cgcompile.release() (and torch._dynamo.reset(), which calls it): every graph goes now, training goes on.

On CPU through the emulate driver; tests/gpu checks that the CUDA graphs themselves are destroyed."""

import copy

import torch
import torch.nn as nn

import cgcompile
from cgcompile.runtime import live_runtimes
from tests import graph_window


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6))


def compiled(model):
    return torch.compile(model, backend="cudagraph_modules",
                         options={"driver": "emulate", "cuda_graph_warmup_steps": 1})


def train(compiled_model, model, reference, steps):
    for step in range(steps):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step))
        out, expected = compiled_model(x), reference(x)
        torch.testing.assert_close(out, expected)
        out.sum().backward(), expected.sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def test_release_drops_every_graph_and_the_model_captures_again():
    graph_window.fresh()  # runtimes earlier tests left in reference cycles go now, not at a later collection
    model = mlp()
    reference = copy.deepcopy(model)
    cmodel = compiled(model)
    train(cmodel, model, reference, 3)
    assert [g["kind"] for g in cgcompile.stats()["graphs"]] == ["forward", "backward"]
    cgcompile.release()
    assert cgcompile.stats()["graphs"] == []
    cgcompile.reset_stats()
    train(cmodel, model, reference, 3)  # warmup, capture, replay again
    assert cgcompile.stats()["graphs_captured"] == 2 and len(cgcompile.stats()["graphs"]) == 2


def test_dynamo_reset_releases_through_the_backend_hook():
    model = mlp()
    cmodel = compiled(model)
    train(cmodel, model, copy.deepcopy(model), 3)
    runtimes = [r for r in live_runtimes() if r.runners()]
    assert runtimes and cgcompile.stats()["graphs"]
    torch._dynamo.reset()
    assert cgcompile.stats()["graphs"] == []
    assert all(p.bank_size() == 0 for r in runtimes for p in r.runners())


def test_a_backward_pending_across_release_runs_eagerly_and_is_exact():
    model = mlp()
    reference = copy.deepcopy(model)
    cmodel = compiled(model)
    train(cmodel, model, reference, 3)
    x = torch.randn(3, 6)
    out, expected = cmodel(x), reference(x)  # a replayed forward; its backward is still to come
    cgcompile.release()
    out.sum().backward(), expected.sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_stats_report_the_bytes_each_graph_holds():
    model = mlp()
    cmodel = compiled(model)
    train(cmodel, model, copy.deepcopy(model), 3)
    forward, backward = cgcompile.stats()["graphs"]
    assert forward["static_input_bytes"] == 3 * 6 * 4  # the input batch: the one copied-in buffer
    assert backward["static_input_bytes"] == 3 * 6 * 4  # the incoming gradient
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert backward["static_output_bytes"] == weights  # one gradient per parameter
    assert forward["pool_bytes"] == backward["pool_bytes"] == 0  # emulate reserves no device memory


"""cgcompile.capture_step: a whole training step as one graph (emulate driver on CPU)."""

import copy

import pytest
import torch
import torch.nn as nn

import cgcompile
from cgcompile import reset_stats, stats
from tests.models import MODELS


def make_step(model, optimizer, spec):
    def step(tokens):
        optimizer.zero_grad(set_to_none=True)
        loss = spec.loss(model, tokens)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def test_n_steps_equal_eager_losses_and_parameters():
    spec = MODELS["dense_gpt"]
    model = spec.make()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step = cgcompile.capture_step(make_step(model, opt, spec), warmup_steps=2, driver="emulate")
    ref_step = make_step(reference, ref_opt, spec)
    reset_stats()
    for i in range(6):
        (tokens,) = spec.example_inputs(seed=i)  # a new batch every step: copied into the static buffer
        torch.testing.assert_close(step(tokens), ref_step(tokens), rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert stats()["graphs_captured"] == 1 and stats()["steady_replays"] == 3


def test_returned_loss_is_not_overwritten_by_the_next_replay():
    spec = MODELS["dense_gpt"]
    model = spec.make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cgcompile.capture_step(make_step(model, opt, spec), warmup_steps=1, driver="emulate")
    losses = [step(spec.example_inputs(seed=i)[0]) for i in range(4)]
    kept = [loss.clone() for loss in losses]
    step(spec.example_inputs(seed=9)[0])
    assert all(torch.equal(a, b) for a, b in zip(losses, kept))
    assert len({loss.item() for loss in losses}) == 4


def test_forward_only_validation_has_its_own_graph():
    spec = MODELS["dense_gpt"]
    model = spec.make()
    evaluate = cgcompile.capture_step(lambda tokens: spec.loss(model, tokens), warmup_steps=1, driver="emulate")
    reset_stats()
    with torch.no_grad():
        for i in range(3):
            (tokens,) = spec.example_inputs(seed=i)
            torch.testing.assert_close(evaluate(tokens), spec.loss(model, tokens), rtol=0, atol=0)
    assert stats()["graphs_captured"] == 1 and stats()["steady_replays"] == 1


def test_non_capturable_optimizer_is_a_clear_error():
    spec = MODELS["dense_gpt"]
    model = spec.make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = cgcompile.capture_step(make_step(model, opt, spec), driver="emulate")
    with pytest.raises(cgcompile.ConfigError, match=r"Adam param group 0 has capturable=False.*capturable=True"):
        step(*spec.example_inputs())


def test_sync_inside_the_step_is_listed_with_its_line():
    lin = nn.Linear(4, 4)

    def step(x):
        loss = lin(x).pow(2).mean()
        loss.backward()
        if loss.item() > 1e9:  # SYNC
            raise AssertionError
        return loss.detach()

    captured = cgcompile.capture_step(step, driver="emulate")
    with pytest.raises(cgcompile.ConfigError) as info:
        captured(torch.randn(2, 4))
    import inspect
    lines, start = inspect.getsourcelines(step)
    line = start + next(i for i, text in enumerate(lines) if "# SYNC" in text)
    assert f"{__file__}:{line}: " in str(info.value) and "syncs with the host" in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"warmup_steps": 0}, r"warmup_steps=0 must be an int >= 1"),
    ({"driver": "cuda_graphs"}, r"driver='cuda_graphs' is not valid; choose one of auto, cuda, emulate, eager"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(cgcompile.ConfigError, match=message):
        cgcompile.capture_step(lambda x: x, **kwargs)


def test_auto_driver_on_cpu_runs_eagerly():
    calls = []

    def step(x):
        calls.append(1)
        return x * 2

    captured = cgcompile.capture_step(step)
    for _ in range(5):
        assert torch.equal(captured(torch.ones(2)), torch.full((2,), 2.0))
    assert len(calls) == 5

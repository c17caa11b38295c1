"""Gradients a backward graph hands straight to the caller, not through AccumulateGrad into .grad: the result of
`torch.autograd.grad`, and the grad a tensor hook stores. The caller may keep them past the step (the previous
step's gradients kept for a comparison), so the next replay must not write over them: they are aliases of graph
memory whose storage use count the runtime sees, and positions found kept are handed out as copies from then on.
Tiny dense GPT (tests/models), attn and mlp captured, emulate driver; the loop updates the parameters itself."""

from __future__ import annotations

import copy

import pytest
import torch

from cgcompile import stats
from tests.models import dense_gpt
from tests.test_runtime_traps import assert_close

OPTIONS = {"cuda_graph_modules": ["attn", "mlp"], "driver": "emulate", "cuda_graph_warmup_steps": 1}


class Loop:
    """One model's training loop: grads from `how` ("autograd.grad", or "hook": a hook per parameter stores its
    grad), an SGD update from them, the last `keep` steps' grads kept."""

    def __init__(self, model, call, how: str, keep: int):
        self.model, self.call, self.how, self.keep = model, call, how, keep
        self.kept, self.hooked = [], {}
        if how == "hook":
            for i, p in enumerate(model.parameters()):
                p.register_hook(lambda g, i=i: self.hooked.__setitem__(i, g))

    def step(self, tokens):
        params = list(self.model.parameters())
        loss = dense_gpt.lm_loss(self.call(tokens), tokens)
        if self.how == "hook":
            self.model.zero_grad(set_to_none=True)
            loss.backward()
            grads = [self.hooked[i] for i in range(len(params))]
        else:
            grads = list(torch.autograd.grad(loss, params))
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(0.01 * g)
        self.kept = (self.kept + [grads])[-self.keep:] if self.keep else []
        return grads


def twins(how: str, keep: int, device: str = "cpu", layers: int = 2, **options):
    """(eager loop, compiled loop) over the same tiny dense GPT on `device`, compiled with OPTIONS and `options`."""
    ref = dense_gpt.build(layers).to(device)
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="cudagraph_modules", options={**OPTIONS, **options})
    return Loop(ref, ref, how, keep), Loop(model, compiled, how, keep)


def check_kept_grads(how: str, device: str = "cpu", layers: int = 2, **options) -> list:
    """12 steps keeping the last two steps' grads: every kept grad equals eager's after every step. Returns the
    steady replays counted after each step."""
    eager, ours = twins(how, 2, device, layers, **options)
    steady = []
    for step in range(12):
        tokens = dense_gpt.example_inputs(seed=step, device=device)[0]
        eager.step(tokens)
        ours.step(tokens)
        for expected, got in zip(eager.kept, ours.kept):
            for e, g in zip(expected, got):
                assert_close(g, e)
        steady.append(stats()["steady_replays"])
    return steady


@pytest.mark.parametrize("how", ["autograd.grad", "hook"])
def test_grads_kept_into_the_next_step_stay_eagers_and_the_graphs_replay(how):
    """The capture step's grads, kept into the next step, were written over by its first replay (off by up to
    6e-2 here). Every grad kept must equal eager's; after the first steps every graph replays every step."""
    steady = check_kept_grads(how)
    # 4 graphs (each layer's forward and backward), every one replayed in each of the last steps
    assert [b - a for a, b in zip(steady[-4:], steady[-3:])] == [4, 4, 4], steady
    assert stats()["eager_fallbacks"] == []


def test_every_layer_learns_its_grads_are_kept_at_once():
    """Four layers: the step that finds one layer's grads kept teaches every layer whose grads are held. Learnt
    one layer a step, each step captured new instances of every layer after it (their inputs at new addresses):
    5 captures per layer, no step replaying every graph in 12 steps. Now each layer captures one more instance
    (the holder keeps the grads its first one handed out a step longer), and from step 5 on all 8 graphs replay."""
    steady = check_kept_grads("autograd.grad", layers=4)
    assert [b - a for a, b in zip(steady[4:], steady[5:])] == [8] * 7, steady
    s = stats()
    assert [p["captures"] for p in s["partitions"]] == [2] * 4, s["partitions"]
    assert s["eager_fallbacks"] == []


def test_grads_used_and_dropped_need_no_copies_and_no_more_graphs():
    """A loop that applies torch.autograd.grad's result and drops it holds nothing: the 4 graphs of the capture
    replay from the next step on, nothing copied."""
    eager, ours = twins("autograd.grad", keep=0)
    for step in range(6):
        tokens = dense_gpt.example_inputs(seed=step)[0]
        for e, g in zip(eager.step(tokens), ours.step(tokens)):
            assert_close(g, e)
    s = stats()
    assert s["graphs_captured"] == 4 and s["steady_replays"] == 4 * 4, s
    assert sum(p["copied_outputs"] for p in s["partitions"]) == 0, s["partitions"]

"""The training traps of CUDA-graph capture on the tiny zoo models (tests/models dense_gpt and moe_mask) with
their recommended modules, end to end through the real backend with the emulate driver (the small models built
for each trap: test_runtime_traps.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cgcompile import reset_stats, stats
from tests.models import MODELS
from tests.test_runtime_traps import assert_captured, assert_close, grads


# --- the tiny zoo models: dense_gpt and moe_mask with their recommended modules ------------------------------


@pytest.fixture(params=["moe_mask", "dense_gpt"], ids=["moe", "dense"])
def spec(request):
    """A zoo model spec; moe_mask needs capture_dynamic_output_shape_ops to keep nonzero in the graph."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        yield MODELS[request.param]


def zoo_compiled(spec, model, **overrides):
    options = spec.options(driver="emulate", cuda_graph_warmup_steps=1)
    options.update(overrides)
    return torch.compile(model, backend="cudagraph_modules", options=options)


def zoo_twins(spec, **kwargs):
    return spec.make(**kwargs), spec.make(**kwargs)


def test_tiny_models_train_like_eager(spec):
    """fwd, fwd, bwd, bwd then an SGD step: grads, losses and parameters equal eager's. The MoE's
    data-dependent dispatch (nonzero, gather, index_add_) stays eager; attention, router and preprocess are
    captured."""
    model, ref = zoo_twins(spec)
    cmodel = zoo_compiled(spec, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # (Adam would amplify sum-order differences in tiny grads)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        for m, o, fn in ((model, opt, cmodel), (ref, opt_ref, ref)):
            losses = [spec.loss(fn, spec.example_inputs(seed=2 * step + i)[0]) for i in range(2)]
            for loss in losses:  # fwd, fwd, bwd, bwd
                loss.backward()
            m.last = [loss.detach() for loss in losses]
            m.last_grads = [p.grad.clone() for p in m.parameters()]
            o.step()
            o.zero_grad()
        for a, b in zip(model.last + model.last_grads, ref.last + ref.last_grads):
            assert_close(a, b)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_close(a, b)
    with torch.no_grad():
        tokens = spec.example_inputs(seed=99)[0]
        for _ in range(3):
            assert_close(cmodel(tokens), ref(tokens))
    s = assert_captured()
    assert s["eager_fallbacks"] == [] and s["recaptures"] == []


def test_moe_held_out_trains_like_eager():
    """The issue's check, options verbatim (default warmup): SGD steps, then Adam steps, equal eager's."""
    spec = MODELS["moe_mask"]
    model, ref = zoo_twins(spec)
    options = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "moe_router", "moe_preprocess"],
               "driver": "emulate"}
    cmodel = torch.compile(model, backend="cudagraph_modules", options=options)
    optimizers = [(torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)),
                  (torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3))]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for step in range(10):  # 3 warmup calls, then capture and replays; SGD for 5 steps, then Adam
            opt, opt_ref = optimizers[step // 5]
            tokens = spec.example_inputs(seed=step)[0]
            losses = []
            for m, o, fn in ((model, opt, cmodel), (ref, opt_ref, ref)):
                o.zero_grad()
                loss = spec.loss(fn, tokens)
                loss.backward()
                o.step()
                losses.append(loss.detach())
            assert_close(losses[0], losses[1])
            for a, b in zip(model.parameters(), ref.parameters()):
                assert_close(a, b)
    s = stats()
    assert s["graphs_captured"] > 0 and s["steady_replays"] > 0, s
    assert s["eager_fallbacks"] == [] and s["recaptures"] == []


def test_tiny_models_output_kept_from_step_k_is_unchanged_after_step_k_plus_1(spec):
    """Logits held across the next training step. With whole-layer modules and clone_outputs=False the
    logits come straight out of a captured graph (the final norm and head are a partition of their own)."""
    for overrides in ({}, {"cuda_graph_modules": [], "clone_outputs": False}):
        torch._dynamo.reset()
        model, ref = zoo_twins(spec)
        cmodel = zoo_compiled(spec, model, **overrides)
        opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        kept = []
        for step in range(4):
            tokens = spec.example_inputs(seed=step)[0]
            outs = []
            for o, fn in ((opt, cmodel), (opt_ref, ref)):
                o.zero_grad()
                logits = fn(tokens)
                F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
                o.step()
                outs.append(logits)
            kept.append(outs)
        for out, expected in kept:
            assert_close(out, expected)
        s = assert_captured()
        assert s["eager_fallbacks"] == []
        reset_stats()


class InputMutation(nn.Module):
    """A zoo model in a frame that mutates a graph input in place, then returns something that reads it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, acc):
        logits = self.model(tokens)
        acc.mul_(0.5).add_(logits.detach())
        return logits + acc


def test_tiny_models_in_place_mutation_of_an_input(spec):
    model, ref = zoo_twins(spec)
    cmodel = zoo_compiled(spec, InputMutation(model))
    wrapped_ref = InputMutation(ref)
    for step in range(4):
        tokens = spec.example_inputs(seed=step)[0]
        acc = torch.ones(*tokens.shape, spec.module.VOCAB)
        acc2 = acc.clone()
        model.zero_grad(), ref.zero_grad()
        out, expected = cmodel(tokens, acc), wrapped_ref(tokens, acc2)
        assert_close(out, expected)
        assert_close(acc, acc2)
        out.square().mean().backward()
        expected.square().mean().backward()
        for a, b in zip(grads(model), grads(ref)):
            assert_close(a, b)
    s = assert_captured()
    assert s["eager_fallbacks"] == []


def test_dense_dropout_fresh_masks_and_grads_consistent_with_them():
    """dense_gpt with dropout 0.1. Emulate replays re-run the graph, drawing from the CPU generator in eager's
    order: seeded alike, a replayed step equals eager exactly, so each replay draws fresh masks and the grads
    match them. (The capture step is the exception: the emulated capture runs the graph once more.)"""
    spec = MODELS["dense_gpt"]
    model, ref = zoo_twins(spec, dropout=0.1)
    cmodel = zoo_compiled(spec, model)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    tokens = spec.example_inputs(seed=0)[0]  # the same tokens every step: only the masks (and weights) change
    for step in range(5):
        if step == 2:  # warmup step 0, capture step 1 (parameters differ from eager's from here, so re-sync)
            captured = stats()["graphs_captured"]
            with torch.no_grad():
                for a, b in zip(model.parameters(), ref.parameters()):
                    a.copy_(b)
        for m, o, fn in ((model, opt, cmodel), (ref, opt_ref, ref)):
            o.zero_grad()
            torch.manual_seed(1000 + step)
            loss = spec.loss(fn, tokens)
            loss.backward()
            m.last = [loss.detach()] + [p.grad.clone() for p in m.parameters()]
            o.step()
        if step >= 2:
            for a, b in zip(model.last, ref.last):
                assert_close(a, b)
            with torch.no_grad():
                torch.manual_seed(2000 + step)
                other = spec.loss(ref, tokens)  # other masks, other loss: the masks do matter here
            assert not torch.allclose(other, ref.last[0])
    s = assert_captured()
    assert s["graphs_captured"] == captured  # steps 2.. replayed: fresh masks come from replays
    assert s["eager_fallbacks"] == [] and s["recaptures"] == []


def test_tiny_models_train_eval_switch(spec):
    kwargs = {"dropout": 0.3} if spec.name == "dense_gpt" else {}
    model, ref = zoo_twins(spec, **kwargs)
    cmodel = zoo_compiled(spec, model)
    for step in range(3):
        model.train(), ref.train()
        spec.loss(cmodel, spec.example_inputs(seed=step)[0]).backward()
        model.eval(), ref.eval()
        tokens = spec.example_inputs(seed=100 + step)[0]
        with torch.no_grad():
            assert_close(cmodel(tokens), ref(tokens))
        assert_close(cmodel(tokens), ref(tokens))  # eval with grad enabled
    s = assert_captured()
    assert s["eager_fallbacks"] == []


def test_tiny_models_same_partition_twice_in_one_step(spec):
    """Two forwards into one loss, one backward: the second call of each partition needs its own instance."""
    model, ref = zoo_twins(spec)
    cmodel = zoo_compiled(spec, model)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        t1, t2 = (spec.example_inputs(seed=2 * step + i)[0] for i in range(2))
        for m, o, fn in ((model, opt, cmodel), (ref, opt_ref, ref)):
            o.zero_grad()
            loss = spec.loss(fn, t1) + spec.loss(fn, t2)
            loss.backward()
            m.last = [loss.detach()] + [p.grad.clone() for p in m.parameters()]
            o.step()
        for a, b in zip(model.last, ref.last):
            assert_close(a, b)
        if step == 1:
            captured = stats()["graphs_captured"]
    s = assert_captured()
    assert s["graphs_captured"] == captured  # two instances per partition, then only replays
    assert s["eager_fallbacks"] == [] and s["recaptures"] == []


def test_tiny_models_no_grad_inference(spec):
    model, ref = zoo_twins(spec)
    cmodel = zoo_compiled(spec, model)
    with torch.no_grad():
        outs = [(cmodel(t), ref(t)) for t in (spec.example_inputs(seed=s)[0] for s in range(4))]
    for out, expected in outs:
        assert_close(out, expected)
        assert not out.requires_grad
    s = assert_captured()
    assert s["eager_fallbacks"] == []

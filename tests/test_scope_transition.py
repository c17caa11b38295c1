"""cgcompile.transition_cudagraph_scope(model, "full" | "partial"), Megatron's MoE layer switch (scope.py): 'full'
captures whole layers with the expert loop padded, 'partial' the configured modules (attention, router and its
preprocessing; the expert loop eager). An RL-style loop switches back and forth: each scope is planned once from
Dynamo's one trace, keeps its graphs, and both train and evaluate like eager."""

import copy
import logging

import pytest
import torch
from expecttest import assert_expected_inline

import cgcompile
from cgcompile.backend import record_plans
from tests.models import MODELS

SPEC = MODELS["moe_mask"]
OPTIONS = SPEC.options(driver="emulate", cuda_graph_warmup_steps=1)  # modules: attn, moe_router, moe_preprocess
ROUNDS, STEPS = 3, 2


def run_phase(spec, compiled, model, reference, seed):
    """STEPS training steps (loss and every gradient like eager), then STEPS no-grad forwards (logits)."""
    for step in range(STEPS):
        (tokens,) = spec.example_inputs(seed=seed + step)
        loss, ref = spec.loss(compiled, tokens), spec.loss(reference, tokens)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
            p.grad = q.grad = None
    with torch.no_grad():
        for step in range(STEPS):
            (tokens,) = spec.example_inputs(seed=seed + 50 + step)
            torch.testing.assert_close(compiled(tokens), reference(tokens), rtol=1e-6, atol=1e-6)


def dynamo_graphs() -> int:
    """Graphs Dynamo has traced in this process (torch._dynamo.reset() does not clear the count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_switching_scope_back_and_forth_replans_once_per_scope_and_reuses_its_graphs(caplog):
    caplog.set_level(logging.INFO, logger="cgcompile")
    traced = dynamo_graphs()
    model = SPEC.make()
    reference = copy.deepcopy(model)
    captured, replays = [], []
    with torch._dynamo.config.patch(SPEC.dynamo_flags()), record_plans() as rec:
        compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
        cgcompile.reset_stats()
        for round_ in range(ROUNDS):
            for scope in ("full", "partial"):
                cgcompile.transition_cudagraph_scope(compiled, scope)
                run_phase(SPEC, compiled, model, reference, seed=100 * round_ + (scope == "full"))
                captured.append(cgcompile.stats()["graphs_captured"])
                replays.append(cgcompile.stats()["steady_replays"])
    # Dynamo traced one graph per grad mode; each was planned once per scope (round 1: "full" first), never again
    assert dynamo_graphs() - traced == 2
    assert [p.training for p in rec.graphs] == [True, False, True, False]
    for plan in rec.graphs[:2]:  # full: whole layers, the expert loop padded and captured
        eager = {r.category for q in plan.partitions if not q.captured for r in q.reasons}
        assert eager <= {"too_small"} and any(q.padding for q in plan.partitions), str(plan)
    for plan in rec.graphs[2:]:  # partial: attention, router and preprocess captured, the expert loop eager
        eager = {r.category for q in plan.partitions if not q.captured for r in q.reasons}
        assert "dynamic_shape" in eager and not any(q.padding for q in plan.partitions), str(plan)
    # the first round captures both scopes (warmup 1: each scope's second step captures); later rounds replay
    assert captured[1] > captured[0] > 0 and len(set(captured[1:])) == 1, captured
    assert all(b > a for a, b in zip(replays[1:], replays[2:])), replays
    assert cgcompile.stats()["eager_fallbacks"] == []
    switches = [r.getMessage() for r in caplog.records if "capture scope" in r.getMessage()]
    assert len(switches) == 2  # the training graph, then the no-grad graph, each once
    assert_expected_inline(switches[0], """cgcompile: capture scope 'partial' reached a compiled graph for the first time: planning it for that scope from Dynamo's trace (no new trace); the graphs of scope 'full' stay for when it comes back""")


def test_a_bad_scope_is_one_clear_error_naming_the_choices():
    model = SPEC.make()
    with pytest.raises(cgcompile.ConfigError) as info:
        cgcompile.transition_cudagraph_scope(model, "ful")
    assert_expected_inline(str(info.value), """transition_cudagraph_scope mode='ful' is not a valid choice; did you mean 'full'? valid choices: 'full', 'partial'""")
    with pytest.raises(cgcompile.ConfigError) as info:
        cgcompile.transition_cudagraph_scope(model.forward, "full")
    assert_expected_inline(str(info.value), """transition_cudagraph_scope takes the model (an nn.Module, compiled or not), got method""")


def test_layers_compiled_one_by_one_follow_their_own_scope():
    """Per-block compile (torchtitan's `layer.compile()`): Dynamo shares one frame between the layers, and each
    layer's calls run the scope set for that layer (Megatron switches per MoE layer)."""
    traced = dynamo_graphs()
    model = SPEC.make()
    reference = copy.deepcopy(model)
    with torch._dynamo.config.patch(SPEC.dynamo_flags()), record_plans() as rec:
        for layer in model.layers:
            layer.compile(backend="cudagraph_modules", options=OPTIONS)
        cgcompile.transition_cudagraph_scope(model.layers[0], "full")
        cgcompile.reset_stats()
        run_phase(SPEC, model, model, reference, seed=0)
        run_phase(SPEC, model, model, reference, seed=100)  # the graphs captured in the first are reused
    assert dynamo_graphs() - traced == 2  # one frame per grad mode, shared by both layers
    padded = [any(q.padding for q in plan.partitions) for plan in rec.graphs]
    assert sorted(padded) == [False, False, True, True], padded  # per grad mode: layer 0 full, layer 1 partial
    assert cgcompile.stats()["steady_replays"] > 0 and cgcompile.stats()["eager_fallbacks"] == []


def test_what_each_scope_compiles_with():
    from cgcompile.scope import LayerScope, scope_config
    given = cgcompile.CudaGraphConfig.from_options(OPTIONS)
    assert scope_config(given, LayerScope.PARTIAL) is given
    full = scope_config(given, LayerScope.FULL)
    assert (full.cuda_graph_modules, full.dynamic_padding, full.driver) == ((), "max", "emulate")
    buckets = cgcompile.CudaGraphConfig.from_options(dict(OPTIONS, dynamic_padding="buckets"))
    assert scope_config(buckets, LayerScope.FULL).dynamic_padding == "buckets"
    te = cgcompile.CudaGraphConfig.from_options({"cuda_graph_impl": "transformer_engine",
                                                 "cuda_graph_modules": ["attn"]})
    te_full = scope_config(te, LayerScope.FULL)
    assert (te_full.cuda_graph_modules, te_full.dynamic_padding) == ((), "off")  # padding: the local impl only
    whole_step = cgcompile.CudaGraphConfig.from_options({"cuda_graph_impl": "full_iteration"})
    assert scope_config(whole_step, LayerScope.FULL) is whole_step

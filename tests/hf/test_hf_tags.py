"""cgcompile.tag_hf: one call tags every covered family's attention, MLP, sparse-MoE block, router and
experts; with transformers 5's eager experts loop (a Dynamo break inside the tagged block) the selected
tag still reaches every graph of the block and training matches eager, captured and replayed."""

import pytest
import torch
from expecttest import assert_expected_inline

import cgcompile
from cgcompile.backend import record_plans
from tests.hf.families import CONFIGS, MOE_FAMILIES, build, tokens, train_like_eager


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_tag_hf_tags_each_role_of_every_covered_family(family):
    model = build(family)
    counts = cgcompile.tag_hf(model)
    layers = model.config.num_hidden_layers
    assert counts["attn"] == layers
    if family in MOE_FAMILIES:
        moe_layers = layers - getattr(model.config, "first_k_dense_replace", 0)
        assert counts["moe"] == counts["moe_router"] == counts["moe_experts"] == moe_layers, counts
    else:
        assert counts == {"attn": layers, "mlp": layers}
    attn = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    assert cgcompile.tag_of(attn) == "attn"
    assert set(cgcompile.HF_FAMILIES) == set(CONFIGS)


def test_tag_hf_names_the_covered_families_for_another_model():
    model = build("llama")
    model.config.model_type = "not_a_family"
    with pytest.raises(cgcompile.ConfigError, match="covered families: deepseek_v3, gpt2, gpt_oss, llama"):
        cgcompile.tag_hf(model)


def test_selected_moe_tag_survives_the_eager_experts_loop_break():
    model = build("mixtral", experts_implementation="eager")
    cgcompile.tag_hf(model)
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "cuda_graph_modules": ["moe"]})
    cgcompile.reset_stats()
    with record_plans() as rec:
        losses, params = train_like_eager(model, compiled, steps=4)
    assert losses == [0.0] * 4 and params <= 1e-6
    moe = [p for plan in rec.graphs for p in plan.partitions if "moe" in p.tags]
    # the block's frame (router) and the experts' frame before the loop: captured, under their model paths
    assert {p.module for p in moe if p.captured} >= {"model.layers.0.mlp", "model.layers.0.mlp.experts"}
    untagged_moe = [p for plan in rec.graphs for p in plan.partitions
                    if (p.module or "").startswith("model.layers.0.mlp") and "moe" not in p.tags]
    assert untagged_moe == []  # every graph inside the block carries its tag
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [] and st["graphs_captured"] > 0 and st["steady_replays"] > 0


def test_selecting_modules_of_an_untagged_model_names_them_and_tag_hf():
    """Forgetting tag_hf: no module carries a tag, the selection matched nothing and nothing was captured, and
    nothing said so (under gradient checkpointing, as Trainer enables it, the modules sit in checkpoint bodies of
    a frame Dynamo compiles after a break). explain() and the first compiled call raise one error naming the
    untagged modules and the call; with it the same model is captured."""
    model = build("llama").train()
    options = {"driver": "emulate", "cuda_graph_modules": ["attn", "mlp"]}
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # Trainer's order
    ids = tokens(0)
    with pytest.raises(cgcompile.ConfigError) as explained:
        cgcompile.explain(model, input_ids=ids, labels=ids, options=options)
    assert_expected_inline(str(explained.value), """\
cuda_graph_modules selects 'attn', 'mlp', but no module in the graph carries that tag; tags present: none. The \
graph holds modules cgcompile.tag_hf(model) tags: model.layers.0.self_attn (LlamaAttention: 'attn'), \
model.layers.0.mlp (LlamaMLP: 'mlp'), model.layers.1.self_attn (LlamaAttention: 'attn') and 1 more. Call \
cgcompile.tag_hf(model) before compiling the model.""")

    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as called:
        compiled(input_ids=ids, labels=ids)
    assert str(explained.value) in str(called.value)
    cgcompile.tag_hf(model)
    torch._dynamo.reset()
    with record_plans() as rec:
        compiled(input_ids=ids, labels=ids).loss.backward()
    captured = sorted({(p.module, tag) for g in rec.graphs for p in g.partitions if p.captured for tag in p.tags})
    assert captured == [(f"model.layers.{i}", tag) for i in range(2) for tag in ("attn", "mlp")], captured

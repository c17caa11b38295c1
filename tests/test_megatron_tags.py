"""cgcompile.tag_megatron on stand-ins named and placed like Megatron-Core's classes (megatron itself needs Python
>= 3.12: tests/test_megatron_train.py tags and trains a real GPTModel where it is importable)."""

import re

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import cgcompile
from cgcompile.errors import ConfigError


def run_children(self, x):
    """Each submodule in turn, added to the input (enough to put every module on Dynamo's module stack)."""
    for child in self.children():
        x = x + child(x)
    return x


def megatron_class(name, module, *bases):
    """A class as Megatron-Core defines it: its name, its module under `megatron.`."""
    return type(name, bases or (nn.Module,), {"__module__": module, "forward": run_children})


IdentityOp = megatron_class("IdentityOp", "megatron.core.transformer.identity_op")
SelfAttention = megatron_class("SelfAttention", "megatron.core.transformer.attention")
MLASelfAttention = megatron_class("MLASelfAttention", "megatron.core.transformer.multi_latent_attention", SelfAttention)
MLP = megatron_class("MLP", "megatron.core.transformer.mlp")
Router = megatron_class("Router", "megatron.core.transformer.moe.router")
TopKRouter = megatron_class("TopKRouter", "megatron.core.transformer.moe.router", Router)
BaseMoELayer = megatron_class("BaseMoELayer", "megatron.core.transformer.moe.moe_layer")
MoELayer = megatron_class("MoELayer", "megatron.core.transformer.moe.moe_layer", BaseMoELayer)
MambaMixer = megatron_class("MambaMixer", "megatron.core.ssm.mamba_mixer")
MambaLayer = megatron_class("MambaLayer", "megatron.core.ssm.mamba_layer")
TransformerLayer = megatron_class("TransformerLayer", "megatron.core.transformer.transformer_layer")


class Linear(nn.Linear):
    def __init__(self):
        super().__init__(8, 8)


def layer(attention, mlp):
    block = TransformerLayer()
    block.self_attention, block.mlp = attention, mlp
    block.self_attention.proj = Linear()
    return block


def moe():
    m = MoELayer()
    m.router, m.experts = TopKRouter(), MLP()  # the experts' MLPs are no dense MLP
    m.router.proj, m.experts.proj = Linear(), Linear()
    return m


def stand_in_model():
    dense, sparse, latent = layer(SelfAttention(), MLP()), layer(SelfAttention(), moe()), layer(MLASelfAttention(),
                                                                                                IdentityOp())
    dense.mlp.proj = Linear()
    mamba = MambaLayer()
    mamba.mixer = MambaMixer()
    mamba.mixer.proj = Linear()
    return nn.ModuleDict({"dense": dense, "sparse": sparse, "latent": latent, "mamba": mamba})


def test_tag_megatron_tags_each_role_by_class_and_position():
    model = stand_in_model()
    counts = cgcompile.tag_megatron(model)
    assert counts == {"attn": 3, "mlp": 1, "moe": 1, "moe_router": 1, "mamba": 1}
    tags = {name: cgcompile.tag_of(m) for name, m in model.named_modules() if cgcompile.tag_of(m)}
    assert tags == {"dense.self_attention": "attn", "dense.mlp": "mlp", "sparse.self_attention": "attn",
                    "sparse.mlp": "moe", "sparse.mlp.router": "moe_router", "latent.self_attention": "attn",
                    "mamba.mixer": "mamba"}
    assert isinstance(model["latent"].self_attention, SelfAttention)  # tagging keeps the class's identity


def test_tag_megatron_selects_what_megatron_partial_graphs_capture():
    model = layer(SelfAttention(), moe())
    cgcompile.tag_megatron(model)
    plan = cgcompile.explain(model, torch.randn(4, 8), options={"driver": "emulate",
                                                               "cuda_graph_modules": ["attn", "moe_router"]})
    captured = {tag for g in plan.graphs for p in g.partitions if p.captured for tag in p.tags}
    assert captured == {"attn", "moe_router"}


def test_selecting_modules_of_an_untagged_megatron_model_names_tag_megatron():
    """A Megatron-Core layer compiled with a selection but never tagged: nothing could be captured. explain() and
    the first compiled call raise one error naming the layer, what tag_megatron would tag in it, and the call."""
    options = {"driver": "emulate", "cuda_graph_modules": ["attn", "moe_router"]}
    model = layer(SelfAttention(), moe())
    with pytest.raises(ConfigError) as explained:
        cgcompile.explain(model, torch.randn(4, 8), options=options)
    assert_expected_inline(str(explained.value), """\
cuda_graph_modules selects 'attn', 'moe_preprocess', 'moe_router', but no module in the graph carries that tag; \
tags present: none. The graph holds modules cgcompile.tag_megatron(model) tags: mlp (MoELayer: 'moe'), mlp.router \
(TopKRouter: 'moe_router'). Call cgcompile.tag_megatron(model) before compiling the model.""")

    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=re.escape(str(explained.value))):
        compiled(torch.randn(4, 8))


def test_tag_megatron_says_when_it_finds_nothing():
    with pytest.raises(ConfigError, match="tag_megatron found no Megatron-Core TransformerLayer"):
        cgcompile.tag_megatron(nn.Sequential(nn.Linear(2, 2)))

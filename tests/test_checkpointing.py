"""Activation checkpointing (torch.utils.checkpoint; Dynamo traces reentrant and non-reentrant calls alike) through
the backend: the higher-order ops it brings pass through capture, a checkpoint around an eager island or holding a
selected module is inlined with its nodes tagged for recomputation (cgcompile/rewrites/checkpoint_inline.py), and
one left to run eagerly keeps its random ops' masks for backward (cgcompile/rewrites/checkpoint_eager.py)."""

import copy
import functools
import inspect
import re

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import cgcompile
from cgcompile.backend import record_plans
from cgcompile.rewrites.checkpoint_inline import inline_checkpoints

OPTIONS = {"driver": "emulate", "cuda_graph_warmup_steps": 1, "cuda_graph_modules": []}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)  # a seeded op: rng replayed
        return self.out(a.transpose(1, 2).reshape(2, 8, 16))


@torch.library.custom_op("cgtest::host_scale", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def host_scale(x: torch.Tensor) -> torch.Tensor:
    """Reads a device value on the host, as transformers' fp32 grouped-mm fallback does."""
    return x * (1.0 + float(x.detach().abs().max() > 100.0))


host_scale.register_fake(lambda x: torch.empty_like(x))
host_scale.register_autograd(lambda ctx, g: g * ctx.scale,
                             setup_context=lambda ctx, inputs, output: setattr(ctx, "scale", 1.0))


class IslandBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(host_scale(torch.relu(self.up(x))))


class Model(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])

    def forward(self, x):
        for b in self.blocks:
            x = x + ckpt.checkpoint(b, x, use_reentrant=False)
        return x.pow(2).mean()


def _train(block, steps=4, options=OPTIONS, model=None, input_grad=False):
    torch.manual_seed(0)
    model = Model(block) if model is None else model
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    cgcompile.reset_stats()
    with record_plans() as rec:
        for step in range(steps):
            x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(step)).requires_grad_(input_grad)
            torch.manual_seed(step)
            loss = compiled(x)
            loss.backward()
            torch.manual_seed(step)
            ref = reference(x)
            ref.backward()
            torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    return rec.graphs, cgcompile.stats()


def test_checkpointed_attention_with_dropout_is_captured_and_replayed():
    _, st = _train(Attention)
    assert st["eager_fallbacks"] == []
    graphs = st["graphs"]
    assert graphs and all(g["steady_replays"] >= 2 for g in graphs)  # captured at step 2, run again at 3 and 4


def test_a_checkpoint_around_an_island_is_inlined_and_its_captured_parts_recompute():
    plans, st = _train(IslandBlock)
    assert st["eager_fallbacks"] == []
    (plan,) = plans
    islands = [p for p in plan.partitions if not p.captured]
    assert [r.op for p in islands for r in p.reasons] == ["cgtest.host_scale.default"] * 2
    assert all(g["steady_replays"] >= 2 for g in st["graphs"])


def test_inlined_checkpoint_nodes_carry_aot_autograds_recompute_tags():
    seen = []

    def backend(gm, example_inputs):
        seen.append(inline_checkpoints(gm))
        seen.append([n for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch.compile(Model(IslandBlock), backend=backend)(torch.randn(2, 8, 16)).backward()
    inlined, nodes = seen
    assert len(inlined) == 2 and not any("checkpoint" in str(n.target) for n in nodes)
    regions = {n.meta.get("ac_graph_id") for n in nodes if n.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE}
    assert len(regions) == 2  # one per checkpoint call
    island = next(n for n in nodes if n.target is torch.ops.cgtest.host_scale.default)
    assert island.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE  # aot keeps it eager: it is an island


@cgcompile.tag("attn")
class TaggedAttention(Attention):
    pass


@cgcompile.tag("mlp")
class TaggedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(F.dropout(F.gelu(self.up(x)), 0.1, self.training))


class Layer(nn.Module):
    """A decoder layer as Hugging Face and torchtitan checkpoint it whole: tagged attention and MLP, untagged norms."""

    def __init__(self, attention=TaggedAttention):
        super().__init__()
        self.norm_1, self.attn, self.norm_2, self.mlp = nn.LayerNorm(16), attention(), nn.LayerNorm(16), TaggedMLP()

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class CheckpointedLayers(nn.Module):
    def __init__(self, use_reentrant=False, checkpointed=True, attention=TaggedAttention):
        super().__init__()
        self.layers = nn.ModuleList([Layer(attention), Layer(attention)])
        self.use_reentrant, self.checkpointed = use_reentrant, checkpointed

    def forward(self, x):
        for layer in self.layers:
            x = ckpt.checkpoint(layer, x, use_reentrant=self.use_reentrant) if self.checkpointed else layer(x)
        return x.pow(2).mean()


SELECTED = dict(OPTIONS, cuda_graph_modules=["attn", "mlp"])


def _saved_bytes(st):
    return sum(g["saved_output_bytes"] for g in st["graphs"] if g["kind"] == "forward")


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_selected_modules_inside_a_checkpointed_layer_are_captured_replayed_and_recomputed(use_reentrant):
    """A checkpoint is one opaque node to the planner: the tagged attention and MLP inside it used to stay eager
    (nothing captured, and their dropout redrawn in backward). Inlined, each layer is a partition replayed with eager's
    gradients, and its graph saves less for backward than without the checkpoint: aot recomputes inside it."""
    # eager's reentrant checkpoint passes gradients on only from inputs that require them
    plans, st = _train(None, options=SELECTED, model=CheckpointedLayers(use_reentrant), input_grad=use_reentrant)
    (plan,) = plans
    assert [p.tags for p in plan.partitions if p.captured] == [("attn", "mlp")] * 2  # one partition a layer
    assert st["eager_fallbacks"] == [] and len(st["graphs"]) == 4  # 2 partitions, forward and backward each
    assert all(g["steady_replays"] >= 2 for g in st["graphs"])
    _, plain = _train(None, options=SELECTED, model=CheckpointedLayers(checkpointed=False))
    assert _saved_bytes(st) < _saved_bytes(plain)


@pytest.mark.parametrize("where", ["eager_partition", "eager_frame"])
def test_a_checkpoint_left_eager_keeps_its_dropout_mask_for_backward(where):
    """torch 2.13 runs the checkpoint op outside aot_autograd without preserving the random state (its
    backend="eager" gives other gradients here; 2.11 skips the checkpoint): an eager partition (untagged attention
    next to the tagged MLP) and a frame run eagerly whole (the eager driver) run the user's checkpoint call
    instead, with eager's gradients (which _train checks)."""
    if where == "eager_partition":
        plans, st = _train(None, options=dict(OPTIONS, cuda_graph_modules=["mlp"]), model=AttentionThenMLP())
        (plan,) = plans
        (found,) = [r for p in plan.partitions if not p.captured for r in p.reasons
                    if r.op == "torch.ops.higher_order.tag_activation_checkpoint"]
        assert found.location == _checkpoint_call(AttentionThenMLP), found.location  # Dynamo records none for it
        assert st["graphs"] and all(g["steady_replays"] >= 2 for g in st["graphs"])  # the MLP's
    else:
        plans, st = _train(Attention, options=dict(OPTIONS, driver="eager"))
        assert not st["graphs"]
    assert st["eager_fallbacks"] == []


class AttentionThenMLP(nn.Module):
    """A checkpointed untagged attention (dropout inside) beside a tagged MLP."""

    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Attention(), TaggedMLP()

    def forward(self, x):
        x = x + ckpt.checkpoint(self.attn, x, use_reentrant=False)
        return (x + self.mlp(x)).pow(2).mean()


class TestCheckpointPlan(expecttest.TestCase):
    def test_explain_sees_the_modules_a_checkpoint_holds(self):
        plan = cgcompile.explain(CheckpointedLayers(), torch.randn(2, 8, 16), options=SELECTED)
        table = re.sub(r"(\.py):\d+", r"\1:LINE", "\n".join(str(plan).splitlines()[1:]))
        self.assertExpectedInline(table, """\
graph 0 (training, layer scope): 3 partitions, 2 captured, 1 eager; 30/32 ops captured; driver=emulate: capture is \
emulated on the CPU
id  kind     tags      module    ops  first reason
 0  capture  attn+mlp  layers.0   15  -
 1  capture  attn+mlp  layers.1   15  -
 2  eager    -         -           2  untagged: Tensor.pow at test_checkpointing.py:LINE""")

    def test_a_checkpoint_captured_whole_shows_the_modules_it_holds(self):
        plan = cgcompile.explain(CheckpointedLayers(), torch.randn(2, 8, 16), options=OPTIONS)
        self.assertExpectedInline("\n".join(str(plan).splitlines()[2:]), """\
id  kind     tags      module  ops  first reason
 0  capture  attn+mlp  -        32  -""")

    def test_a_selective_checkpoint_holding_an_unselected_module_says_why_it_stays_eager(self):
        """Selective checkpointing's policy applies to the aten ops aot_autograd traces from the whole body, so
        such a body is not inlined; holding a module not selected (attention, with only "mlp" selected), it is not
        captured whole either. Its tags still count as present (no 'no module carries that tag' error), and the
        plan says why and how to capture it."""
        options = dict(OPTIONS, cuda_graph_modules=["mlp"])
        (graph,) = cgcompile.explain(SelectivelyCheckpointed(), torch.randn(2, 8, 16), options=options).graphs
        (finding,) = {p.reasons[0] for p in graph.partitions if not p.captured}
        self.assertExpectedInline(f"{finding.category}: {finding.detail}\nhint: {finding.hint}", """\
untagged: a selective activation checkpoint (context_fn) holding attn, mlp: its policy applies to the whole body, \
captured whole only when every module in it is selected (attn is not)
hint: select every module it holds to capture it whole (aot_autograd applies its policy), or checkpoint without \
context_fn to capture the selected modules in it""")
        assert finding.location == _checkpoint_call(SelectivelyCheckpointed), finding.location


def test_a_selective_checkpoint_holding_selected_modules_only_is_captured_whole_per_layer():
    """The hint's first way: every module in the body selected, the checkpoint is captured whole in its layer's
    partition (aot_autograd applies the policy), replayed, with eager's gradients (dropout inside)."""
    (plan,), st = _train(None, options=SELECTED, model=SelectivelyCheckpointed())
    assert [(p.tags, p.module) for p in plan.partitions if p.captured] == [
        (("attn", "mlp"), "layers.0"), (("attn", "mlp"), "layers.1")]
    assert len(st["graphs"]) == 4 and all(g["steady_replays"] >= 2 for g in st["graphs"])
    assert st["eager_fallbacks"] == []


def _checkpoint_call(model_class) -> str:
    """file:line of the checkpoint call in the class's forward."""
    lines, first = inspect.getsourcelines(model_class.forward)
    return f"{__file__}:{first + next(i for i, line in enumerate(lines) if 'ckpt.checkpoint(' in line)}"


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


class SelectivelyCheckpointed(CheckpointedLayers):
    def forward(self, x):
        for layer in self.layers:
            x = ckpt.checkpoint(layer, x, use_reentrant=False,
                                context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))
        return x.pow(2).mean()


class NestedCheckpoints(nn.Module):
    """A checkpoint inside a checkpointed module, dropout in the inner one."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(16, 16), nn.Linear(16, 16)

    def _inner(self, x):
        return F.dropout(self.inner(x), 0.5, True)

    def _outer(self, x):
        return self.outer(ckpt.checkpoint(self._inner, x, use_reentrant=False)).relu()

    def forward(self, x):
        return ckpt.checkpoint(self._outer, x, use_reentrant=False).pow(2).mean()


def test_a_nested_checkpoint_run_eagerly_keeps_its_dropout_mask():
    """The inner checkpoint lives in the outer one's body: run eagerly, the body's copy is rewritten too."""
    _, st = _train(None, options=dict(OPTIONS, driver="eager"), model=NestedCheckpoints())
    assert not st["graphs"] and st["eager_fallbacks"] == []

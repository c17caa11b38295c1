"""Non-reentrant activation checkpointing (torch.utils.checkpoint, use_reentrant=False) through the backend: the
higher-order ops it brings pass through capture, and a checkpoint around an eager island is inlined with its
nodes tagged for recomputation (cgcompile/rewrites/checkpoint_inline.py)."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch.utils.checkpoint import CheckpointPolicy

import cgcompile
from cgcompile.backend import record_plans
from cgcompile.rewrites.checkpoint_inline import inline_checkpoints_around_islands

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


def _train(block, steps=4):
    torch.manual_seed(0)
    model = Model(block)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    cgcompile.reset_stats()
    with record_plans() as rec:
        for step in range(steps):
            x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(step))
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
        seen.append(inline_checkpoints_around_islands(gm))
        seen.append([n for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch.compile(Model(IslandBlock), backend=backend)(torch.randn(2, 8, 16)).backward()
    inlined, nodes = seen
    assert len(inlined) == 2 and not any("checkpoint" in str(n.target) for n in nodes)
    regions = {n.meta.get("ac_graph_id") for n in nodes if n.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE}
    assert len(regions) == 2  # one per checkpoint call
    island = next(n for n in nodes if n.target is torch.ops.cgtest.host_scale.default)
    assert island.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE  # aot keeps it eager: it is an island

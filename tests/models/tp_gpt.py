"""A tiny Llama-style GPT written for tensor parallelism (torchtitan's layout), and its TP plan.

Block: RMSNorm -> Attention ("attn": separate q, k, v, o projections) -> residual -> RMSNorm -> MLP ("mlp": up,
down) -> residual. Head counts are read from the local projection widths (`view(b, s, -1, head_dim)`), so the
same code runs unsharded and with q/k/v split column-wise across ranks, as torchtitan's Llama does.

`tp_plan(sequence_parallel)` is the `parallelize_module` plan: q/k/v and the MLP's up projection
`ColwiseParallel`, o and down `RowwiseParallel`; with `sequence_parallel=True` the norms run `SequenceParallel`
on sequence shards (Shard(1)), the row-wise projections reduce-scatter into them and the blocks all-gather
their input back (`PrepareModuleInput`).

`build(expert_group=group)` replaces each MLP by the expert-parallel MoE of ep_moe.py over `group` (TP x EP, as
Megatron composes them with sequence parallelism): attention stays tensor-parallel, and each rank routes the tokens
of its own sequence shard to the experts of the group (`tp_plan(sequence_parallel=True, experts=True)`). The MoE's
load-balancing loss is left out (one loss, as the dense model).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import cgcompile

from ._common import MAX_SEQ, VOCAB, lm_loss, seeded, token_inputs
from .moe import RMSNorm

D_MODEL = 32
N_HEADS = 4
HIDDEN = 64


@cgcompile.tag("attn")
class Attention(nn.Module):
    """Causal self-attention; the number of heads comes from q's local width (column-sharded under TP)."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


@cgcompile.tag("mlp")
class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class ExpertMLP(nn.Module):
    """ep_moe.EPMoE over `group` in the MLP's place: its output without the auxiliary loss."""

    def __init__(self, d_model: int, group):
        super().__init__()
        from .ep_moe import EPMoE

        self.moe = EPMoE(d_model, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, hidden: int, expert_group=None):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = MLP(d_model, hidden) if expert_group is None else ExpertMLP(d_model, expert_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TPGPT(nn.Module):
    def __init__(self, num_layers: int = 2, d_model: int = D_MODEL, n_heads: int = N_HEADS, hidden: int = HIDDEN,
                 vocab: int = VOCAB, max_seq: int = MAX_SEQ, expert_group=None):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_seq, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads, hidden, expert_group) for _ in range(num_layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(num_layers: int = 2, seed: int = 0, **kw) -> TPGPT:
    """Deterministic (CPU, float32); every rank builds the same full model before parallelize_module shards it."""
    with seeded(seed):
        return TPGPT(num_layers=num_layers, **kw)


def example_inputs(batch: int = 2, seq: int = 8, seed: int = 0, device=None) -> tuple:
    return token_inputs(batch, seq, seed, VOCAB, device)


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(tokens), tokens)


def tp_plan(sequence_parallel: bool = False, experts: bool = False) -> dict:
    """The per-block `parallelize_module` plan (module path inside a Block -> ParallelStyle). `experts`: the MLP is
    ExpertMLP (needs sequence_parallel): its norm hands it the local sequence shard, nothing else of it is sharded."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(), "attn": gather, "mlp": gather,
                     "attn.o": RowwiseParallel(output_layouts=Shard(1)),
                     "mlp.down": RowwiseParallel(output_layouts=Shard(1))})
    if experts:
        for name in ("mlp", "mlp.up", "mlp.down"):
            plan.pop(name)
        plan["mlp_norm"] = SequenceParallel(use_local_output=True)
    return plan


def parallelize(model: TPGPT, mesh, sequence_parallel: bool = False) -> TPGPT:
    """Shard every block over the 1-D `mesh` (a TP mesh, or the "tp" dimension of a larger one). With sequence
    parallelism the residual stream between blocks is sequence-sharded: the first block splits its input along the
    sequence and the last one gathers its output back (the embeddings, final norm and LM head stay replicated)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    for block in model.layers:
        parallelize_module(block, mesh, tp_plan(sequence_parallel, experts=isinstance(block.mlp, ExpertMLP)))
    if sequence_parallel:
        parallelize_module(model.layers[0], mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
        parallelize_module(model.layers[-1], mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))
    return model

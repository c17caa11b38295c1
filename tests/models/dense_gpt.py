"""A tiny dense GPT: token + learned position embedding, pre-norm blocks (attn, mlp), final norm, LM head.

`SelfAttention` is tagged "attn" and `MLP` is tagged "mlp" by class decorator; nothing in here syncs with
the host or has a data-dependent shape, so with cuda_graph_modules=["attn", "mlp"] every block is capturable.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import cgcompile

from ._common import MAX_SEQ, VOCAB, lm_loss, seeded, token_inputs

D_MODEL = 32
N_HEADS = 4


@cgcompile.tag("attn")
class SelfAttention(nn.Module):
    """Causal multi-head self-attention through scaled_dot_product_attention(is_causal=True)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)
        k = k.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)
        v = v.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, d)
        return self.resid_dropout(self.proj(y))


@cgcompile.tag("mlp")
class MLP(nn.Module):
    """Linear -> GELU -> Linear -> dropout."""

    def __init__(self, d_model: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class DenseGPT(nn.Module):
    def __init__(self, num_layers: int = 2, d_model: int = D_MODEL, n_heads: int = N_HEADS,
                 vocab: int = VOCAB, max_seq: int = MAX_SEQ, dropout: float = 0.0):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_seq, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(num_layers: int = 2, seed: int = 0, *, d_model: int = D_MODEL, n_heads: int = N_HEADS,
          dropout: float = 0.0, **kw) -> DenseGPT:
    """Deterministic tiny dense GPT (CPU, float32). `dropout` > 0 turns dropout on in attn and mlp."""
    with seeded(seed):
        return DenseGPT(num_layers=num_layers, d_model=d_model, n_heads=n_heads, dropout=dropout, **kw)


def example_inputs(batch: int = 2, seq: int = 8, seed: int = 0, device=None) -> tuple:
    return token_inputs(batch, seq, seed, VOCAB, device)


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(tokens), tokens)


class GreedyStep(nn.Module):
    """One decode step on a fixed window: next token = argmax of the last position; the window slides by one.
    (No KV cache in the tiny model: a fixed window keeps shapes static, so the step can be captured.)"""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, window: torch.Tensor):
        next_token = self.model(window)[:, -1].argmax(-1, keepdim=True)
        return torch.cat([window[:, 1:], next_token], dim=1), next_token

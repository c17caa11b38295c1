"""A tiny dense GPT with a static KV cache, for decode (gpt-fast style).

Each attention layer holds its key/value cache as module buffers of a fixed shape
(max_batch, heads, max_seq, head_dim). A call takes the new tokens (batch, seq) and their positions as a
tensor `input_pos` (seq,): the layer writes the new keys/values into the cache rows of this batch
(`cache[:batch]`) in place at those positions (`index_copy_`), then attends over the whole cache with a causal
mask row per position. Nothing reads a device value on the host and every shape is fixed for a fixed batch,
so a decode step plans as one captured graph with inference_cuda_graph_scope="block"; the cache writes go to
buffers, whose addresses never change, so they are capture-safe.

A decode step uses only its own batch rows (`cache[:batch]`, a slice whose size is the batch), which keeps the
model row-independent along the batch: with capture_sizes, padded rows write only cache rows past the real
batch, which no real row reads.

    model = build(max_batch=4, max_seq=32).eval()
    prefill(model, prompt)                      # fills positions 0..T-1, returns the first generated token
    step = DecodeStep(model)                    # compile this one
    token = step(token, positions[T])           # one token per sequence
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

import cgcompile

from ._common import MAX_SEQ, VOCAB, lm_loss, seeded, token_inputs

D_MODEL = 32
N_HEADS = 4
MAX_BATCH = 4


@cgcompile.tag("attn")
class CachedAttention(nn.Module):
    """Causal self-attention reading and writing a static KV cache held in buffers."""

    def __init__(self, d_model: int, n_heads: int, max_batch: int, max_seq: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        shape = (max_batch, n_heads, max_seq, d_model // n_heads)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        k_cache, v_cache = self.k_cache[:b], self.v_cache[:b]
        k_cache.index_copy_(2, input_pos, k)
        v_cache.index_copy_(2, input_pos, v)
        y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


@cgcompile.tag("mlp")
class CachedMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class CachedBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, max_batch: int, max_seq: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CachedAttention(d_model, n_heads, max_batch, max_seq)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = CachedMLP(d_model, 4 * d_model)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), input_pos, mask)
        return x + self.mlp(self.ln2(x))


class KVCacheGPT(nn.Module):
    def __init__(self, num_layers: int = 2, d_model: int = D_MODEL, n_heads: int = N_HEADS, vocab: int = VOCAB,
                 max_batch: int = MAX_BATCH, max_seq: int = MAX_SEQ):
        super().__init__()
        self.max_batch, self.max_seq = max_batch, max_seq
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_seq, d_model)
        self.layers = nn.ModuleList(CachedBlock(d_model, n_heads, max_batch, max_seq) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("causal", torch.ones(max_seq, max_seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) at positions input_pos (seq,) -> logits (batch, seq, vocab); writes the cache."""
        mask = self.causal[input_pos].view(1, 1, input_pos.shape[0], self.max_seq)
        x = self.tok_emb(tokens) + self.pos_emb(input_pos)
        for layer in self.layers:
            x = layer(x, input_pos, mask)
        return self.lm_head(self.norm(x))


class DecodeStep(nn.Module):
    """One greedy decode step: the next token (batch, 1) after `token` (batch, 1) at position `input_pos` (1,)."""

    def __init__(self, model: KVCacheGPT):
        super().__init__()
        self.model = model

    def forward(self, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.model(token, input_pos)[:, -1].argmax(-1, keepdim=True)


def build(num_layers: int = 2, seed: int = 0, *, d_model: int = D_MODEL, n_heads: int = N_HEADS,
          max_batch: int = MAX_BATCH, max_seq: int = MAX_SEQ, **kw) -> KVCacheGPT:
    """Deterministic tiny KV-cache GPT (CPU, float32), cache empty (zeros)."""
    with seeded(seed):
        return KVCacheGPT(num_layers=num_layers, d_model=d_model, n_heads=n_heads, max_batch=max_batch,
                          max_seq=max_seq, **kw)


def example_inputs(batch: int = 2, seq: int = 8, seed: int = 0, device=None) -> tuple:
    return token_inputs(batch, seq, seed, VOCAB, device)


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss of a full-sequence forward from position 0 (writes the cache like a prefill)."""
    return lm_loss(model(tokens, torch.arange(tokens.shape[1], device=tokens.device)), tokens)


def positions(max_seq: int, device=None) -> List[torch.Tensor]:
    """One (1,) position tensor per position, made once: a decode loop then never builds tensors on the host."""
    return [torch.tensor([p], device=device) for p in range(max_seq)]


@torch.no_grad()
def prefill(model: KVCacheGPT, prompt: torch.Tensor) -> torch.Tensor:
    """Write the prompt (batch, T) into the cache at positions 0..T-1; returns the first generated token."""
    logits = model(prompt, torch.arange(prompt.shape[1], device=prompt.device))
    return logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def generate(step, model: KVCacheGPT, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Prefill with `model` (eager), then `steps` decode steps through `step`: the generated tokens (batch, steps+1)."""
    token = prefill(model, prompt)
    pos = positions(model.max_seq, prompt.device)
    out = [token]
    for i in range(steps):
        token = step(token, pos[prompt.shape[1] + i])
        out.append(token)
    return torch.cat(out, dim=1)

"""A tiny HuggingFace-Llama-shaped model with NO cgcompile decorators.

Module names follow HF: model.embed_tokens, model.layers[i].{input_layernorm, self_attn, post_attention_layernorm,
mlp}, model.norm, lm_head; attention uses rotary embeddings (computed once in LlamaModel, passed down) and
grouped-query attention. Tag it with `cgcompile.tag_modules(model, TAG_PATTERNS)`; `build()` does not.
No class here is shared with dense_gpt, so class-level tags there cannot leak in.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import VOCAB, lm_loss, seeded, token_inputs

TAG_PATTERNS = {"model.layers.*.self_attn": "attn", "model.layers.*.mlp": "mlp"}

HIDDEN = 32
N_HEADS = 4
N_KV_HEADS = 2


class LlamaRMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]   # (b, s, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_key_value_heads = n_heads, n_kv_heads
        self.head_dim = hidden // n_heads
        self.q_proj = nn.Linear(hidden, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        n_rep = self.num_heads // self.num_key_value_heads
        out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, n_heads, n_kv_heads)
        self.post_attention_layernorm = LlamaRMSNorm(hidden)
        self.mlp = LlamaMLP(hidden, 2 * hidden)

    def forward(self, hidden_states, position_embeddings):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings)
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class LlamaModel(nn.Module):
    def __init__(self, num_layers: int, hidden: int, n_heads: int, n_kv_heads: int, vocab: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden, n_heads, n_kv_heads) for _ in range(num_layers))
        self.norm = LlamaRMSNorm(hidden)
        self.rotary_emb = LlamaRotaryEmbedding(hidden // n_heads)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, num_layers: int = 2, hidden: int = HIDDEN, n_heads: int = N_HEADS,
                 n_kv_heads: int = N_KV_HEADS, vocab: int = VOCAB):
        super().__init__()
        self.model = LlamaModel(num_layers, hidden, n_heads, n_kv_heads, vocab)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Returns the logits tensor (not an HF output object)."""
        return self.lm_head(self.model(input_ids))


def build(num_layers: int = 2, seed: int = 0, **kw) -> LlamaForCausalLM:
    """Deterministic tiny Llama-shaped model, untagged (call prepare() or cgcompile.tag_modules yourself)."""
    with seeded(seed):
        return LlamaForCausalLM(num_layers=num_layers, **kw)


def prepare(model: nn.Module) -> nn.Module:
    """Tag the model's attention and MLP instances via TAG_PATTERNS."""
    import cgcompile

    return cgcompile.tag_modules(model, TAG_PATTERNS)


def example_inputs(batch: int = 2, seq: int = 8, seed: int = 0, device=None) -> tuple:
    return token_inputs(batch, seq, seed, VOCAB, device)


def loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(input_ids), input_ids)

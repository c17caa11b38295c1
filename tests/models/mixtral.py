"""A tiny Hugging Face Mixtral-shaped MoE with NO cgcompile decorators (tag with `prepare`).

The sparse block follows HF's MixtralSparseMoeBlock loop: router logits -> softmax (float) -> top-k -> renormalise
-> `one_hot(...).permute(2, 1, 0)` expert mask -> per expert `idx, top_x = torch.where(expert_mask[e])`, gather
`hidden[None, top_x]`, expert MLP, scale by `routing_weights[top_x, idx, None]`, `index_add_`.
Variants: `shared_expert=True` adds a Qwen2-MoE-style shared expert (sigmoid-gated, dense over all tokens);
`row_mixing=True` subtracts each expert's mean over its selected tokens, which mixes the selected rows, so the
expert loop cannot be padded exactly (the `not_paddable` case).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import VOCAB, lm_loss, seeded, token_inputs

TAG_PATTERNS = {"model.layers.*.self_attn": "attn", "model.layers.*.block_sparse_moe.gate": "moe_router"}
HIDDEN = 32
N_HEADS = 4
NUM_EXPERTS = 4
TOP_K = 2


class MixtralRMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class MixtralAttention(nn.Module):
    def __init__(self, hidden: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, d))


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, shared_expert: bool, row_mixing: bool):
        super().__init__()
        self.num_experts, self.top_k, self.row_mixing = num_experts, top_k, row_mixing
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(MixtralBlockSparseTop2MLP(hidden, 2 * hidden) for _ in range(num_experts))
        self.shared_expert = MixtralBlockSparseTop2MLP(hidden, 2 * hidden) if shared_expert else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_expert else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, d = hidden_states.shape
        hidden_states = hidden_states.view(-1, d)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = (routing_weights / routing_weights.sum(dim=-1, keepdim=True)).to(hidden_states.dtype)
        final = torch.zeros((b * s, d), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])  # MIXTRAL: where
            current_state = hidden_states[None, top_x].reshape(-1, d)
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            if self.row_mixing:
                current = current - current.mean(0)  # MIXTRAL: mean
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden_states) * torch.sigmoid(self.shared_expert_gate(hidden_states))
            final = final + shared
        return final.reshape(b, s, d)


class MixtralDecoderLayer(nn.Module):
    def __init__(self, hidden, n_heads, num_experts, top_k, shared_expert, row_mixing):
        super().__init__()
        self.input_layernorm = MixtralRMSNorm(hidden)
        self.self_attn = MixtralAttention(hidden, n_heads)
        self.post_attention_layernorm = MixtralRMSNorm(hidden)
        self.block_sparse_moe = MixtralSparseMoeBlock(hidden, num_experts, top_k, shared_expert, row_mixing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class MixtralModel(nn.Module):
    def __init__(self, num_layers, hidden, n_heads, num_experts, top_k, shared_expert, row_mixing):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList(MixtralDecoderLayer(hidden, n_heads, num_experts, top_k, shared_expert,
                                                        row_mixing) for _ in range(num_layers))
        self.norm = MixtralRMSNorm(hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class MixtralForCausalLM(nn.Module):
    def __init__(self, num_layers: int = 2, hidden: int = HIDDEN, n_heads: int = N_HEADS,
                 num_experts: int = NUM_EXPERTS, top_k: int = TOP_K, shared_expert: bool = False,
                 row_mixing: bool = False):
        super().__init__()
        self.model = MixtralModel(num_layers, hidden, n_heads, num_experts, top_k, shared_expert, row_mixing)
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def build(num_layers: int = 2, seed: int = 0, **kw) -> MixtralForCausalLM:
    """Deterministic tiny Mixtral-shaped model (untagged; `prepare` tags it)."""
    with seeded(seed):
        return MixtralForCausalLM(num_layers=num_layers, **kw)


def prepare(model: nn.Module) -> nn.Module:
    import cgcompile

    return cgcompile.tag_modules(model, TAG_PATTERNS)


def example_inputs(batch: int = 2, seq: int = 8, seed: int = 0, device=None) -> tuple:
    return token_inputs(batch, seq, seed, VOCAB, device)


def loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(input_ids), input_ids)

"""Tiny Hugging Face transformers models built from configs in code (no weights, no hub access), one per
family cgcompile covers, and the training loop the HF tests compare with eager."""

from __future__ import annotations

import copy
import os
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub: the configs below are complete

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
_MOE = dict(num_experts_per_tok=2)

CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**_COMMON, **_MOE, num_local_experts=4),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_COMMON, **_MOE, moe_intermediate_size=16, num_experts=4,
                                                     head_dim=8),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**_COMMON, **_MOE, moe_intermediate_size=16, num_experts=4,
                                                     shared_expert_intermediate_size=16),
    "olmoe": lambda: transformers.OlmoeConfig(**_COMMON, **_MOE, num_experts=4),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **dict(_COMMON, num_key_value_heads=4), **_MOE, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8),
    "gpt_oss": lambda: transformers.GptOssConfig(**_COMMON, **_MOE, num_local_experts=4, head_dim=8,
                                                 sliding_window=8,
                                                 layer_types=["sliding_attention", "full_attention"]),
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
# Families tag_hf does not cover, each tested on its own: Qwen3-Next (a gated delta-net layer, then full attention;
# sparse MoE with a shared expert in both).
OTHER_CONFIGS = {
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **_COMMON, **_MOE, moe_intermediate_size=16, num_experts=4, shared_expert_intermediate_size=16, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"]),
}


def build(family: str, seed: int = 0, layers: Optional[int] = None, **kwargs) -> torch.nn.Module:
    """A freshly initialised causal LM of the family, eager attention, fp32, on the CPU (`layers` decoder layers
    instead of the config's)."""
    torch.manual_seed(seed)
    config = (CONFIGS.get(family) or OTHER_CONFIGS[family])()
    if layers is not None:
        config.num_hidden_layers = layers
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                         **kwargs)


def tokens(step: int, batch: int = 2, seq: int = 8) -> torch.Tensor:
    """New tokens every step, the same for the compiled model and its eager twin."""
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1000 + step))


def train_like_eager(model: torch.nn.Module, compiled, steps: int = 4, lr: float = 0.1, check_step=None,
                     keep_loss: bool = True):
    """SGD steps on the compiled model and an eager copy made first; returns the per-step absolute loss
    differences and the largest parameter difference after the last step. `check_step(model, reference)` runs
    after each step's backward, before the optimizer step. keep_loss=False drops each step's loss before the
    next step runs (a loop that keeps it keeps its autograd graph, and with it what custom ops stored there)."""
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=lr) for m in (model, reference))
    loss_diffs = []
    for step in range(steps):
        ids = tokens(step)
        loss, ref = compiled(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
        loss.backward()
        ref.backward()
        if check_step is not None:
            check_step(model, reference)
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
        loss_diffs.append((loss - ref).abs().item())
        if not keep_loss:
            del loss, ref
    param_diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    return loss_diffs, param_diff


def greedy_decode(model: torch.nn.Module, step_fn, prompt: torch.Tensor, steps: int, cache=None):
    """Prefill eagerly, then decode through step_fn with a StaticCache under no_grad, as generate() does; returns
    (tokens, last-position logits), `steps` tokens: the prefill's and steps - 1 decode steps. A `cache` given is
    reset and reused, as generate() reuses its static cache from one call to the next."""
    batch, length = prompt.shape
    if cache is None:
        cache = transformers.StaticCache(config=model.config, max_cache_len=length + steps + 1)
    cache.reset()
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(length))
        tokens, logits = [out.logits[:, -1].argmax(-1, keepdim=True)], [out.logits[:, -1]]
        for i in range(steps - 1):
            position = torch.tensor([length + i])
            out = step_fn(input_ids=tokens[-1], past_key_values=cache, use_cache=True, cache_position=position,
                          position_ids=position.expand(batch, 1))  # a stride-0 input, as generate() passes
            logits.append(out.logits[:, -1].clone())
            tokens.append(logits[-1].argmax(-1, keepdim=True))
    return torch.cat(tokens, 1), torch.stack(logits)

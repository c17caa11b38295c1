"""Tagging preset for Hugging Face transformers models, whose classes users cannot decorate.

`cgcompile.tag_hf(model)` tags each submodule of a covered family by its role: attention "attn", dense MLP
(and shared experts) "mlp", sparse-MoE block "moe", router "moe_router", experts "moe_experts". Instances are
tagged (transformers' classes stay untouched), so `cuda_graph_modules=["attn", "moe_router"]` selects them.
Nothing here imports transformers: the roles are read from the class names each family's modeling file
defines (transformers 5).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch.nn as nn

from .errors import ConfigError
from .tagging import tag

# model_type -> {class name: tag}. The MoE block of GPT-OSS is called GptOssMLP; Qwen2-MoE's and
# DeepSeek-V3's MLP classes are their shared experts (and DeepSeek's dense first layers).
HF_FAMILIES: Dict[str, Dict[str, str]] = {
    "llama": {"LlamaAttention": "attn", "LlamaMLP": "mlp"},
    "gpt2": {"GPT2Attention": "attn", "GPT2MLP": "mlp"},
    "mixtral": {"MixtralAttention": "attn", "MixtralSparseMoeBlock": "moe", "MixtralTopKRouter": "moe_router",
                "MixtralExperts": "moe_experts"},
    "qwen3_moe": {"Qwen3MoeAttention": "attn", "Qwen3MoeMLP": "mlp", "Qwen3MoeSparseMoeBlock": "moe",
                  "Qwen3MoeTopKRouter": "moe_router", "Qwen3MoeExperts": "moe_experts"},
    "qwen2_moe": {"Qwen2MoeAttention": "attn", "Qwen2MoeMLP": "mlp", "Qwen2MoeSparseMoeBlock": "moe",
                  "Qwen2MoeTopKRouter": "moe_router", "Qwen2MoeExperts": "moe_experts"},
    "olmoe": {"OlmoeAttention": "attn", "OlmoeMLP": "mlp", "OlmoeSparseMoeBlock": "moe",
              "OlmoeTopKRouter": "moe_router", "OlmoeExperts": "moe_experts"},
    "deepseek_v3": {"DeepseekV3Attention": "attn", "DeepseekV3MLP": "mlp", "DeepseekV3MoE": "moe",
                    "DeepseekV3TopkRouter": "moe_router", "DeepseekV3Experts": "moe_experts"},
    "gpt_oss": {"GptOssAttention": "attn", "GptOssMLP": "moe", "GptOssTopKRouter": "moe_router",
                "GptOssExperts": "moe_experts"},
}


def tag_hf(model: nn.Module) -> Dict[str, int]:
    """Tag a transformers model's attention, MLP, sparse-MoE block, router and experts; returns how many
    modules got each tag. Raises ConfigError for a family not covered, naming the covered ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    roles = HF_FAMILIES.get(model_type)
    if roles is None:
        raise ConfigError(f"tag_hf does not cover model_type {model_type!r}; covered families: "
                          f"{', '.join(sorted(HF_FAMILIES))}. Tag other models with cgcompile.tag_modules(...)")
    counts: Dict[str, int] = {}
    for module in model.modules():
        name = roles.get(type(module).__name__)
        if name is not None:
            tag(name)(module)
            counts[name] = counts.get(name, 0) + 1
    return counts


def hf_role(cls: type) -> Optional[str]:
    """The tag tag_hf gives modules of this class, in any covered family (None for a class it does not tag)."""
    if not cls.__module__.startswith("transformers."):
        return None
    return next((roles[cls.__name__] for roles in HF_FAMILIES.values() if cls.__name__ in roles), None)

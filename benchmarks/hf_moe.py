"""The Hugging Face MoE training workload both benchmarks share: a tiny transformers Mixtral causal LM built
from a config in code (no weights, no hub), transformers' default experts implementation, new tokens every
step. bench_cpu.py counts its host ops on the emulate driver; bench_gpu.py times it on a lent GPU."""

from __future__ import annotations

import os
from typing import Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the config below is complete: never reach the hub

import torch  # noqa: E402

VOCAB = 64


def build(layers: int = 2, hidden: int = 32, experts: int = 4, heads: int = 4, dtype: torch.dtype = torch.float32,
          device: str = "cpu", seed: int = 0) -> Optional[torch.nn.Module]:
    """A freshly initialised MixtralForCausalLM (top-2, eager attention), or None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden,
                                        num_hidden_layers=layers, num_attention_heads=heads,
                                        num_key_value_heads=max(1, heads // 2), max_position_embeddings=256,
                                        num_local_experts=experts, num_experts_per_tok=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(device=device, dtype=dtype).train()


def tokens(seed: int, batch: int, seq: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1000 + seed)).to(device)


def make_step(model: torch.nn.Module, fn: Callable, batch: int, seq: int, device: str = "cpu",
              pool: int = 8) -> Callable[[], None]:
    """One SGD-free training step (forward, loss, backward, grads to None) on the next batch of the pool."""
    batches = [tokens(seed, batch, seq, device) for seed in range(pool)]
    state = {"i": 0}

    def step():
        ids = batches[state["i"] % len(batches)]
        state["i"] += 1
        fn(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    return step

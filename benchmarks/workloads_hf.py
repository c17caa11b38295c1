"""bench_gpu.py's realistic workloads: Hugging Face transformers models at the sizes people train and serve,
random weights from configs built in code (nothing is downloaded), bf16 on a GPU, new data every step.

  llama-train:     LlamaForCausalLM, hidden 2048, 16 layers, GQA 16/4 heads, MLP 5632, vocab 32000, seq 2048,
                   micro-batch 1: a training step (forward, loss, backward, AdamW step, grads to None).
  qwen3moe-train:  Qwen3MoeForCausalLM, hidden 1024, 8 layers, 16/4 heads, 64 experts top-8, expert width
                   (moe_intermediate_size) 512, seq 1024, transformers' grouped_mm experts (no host read):
                   the same training step.
  qwen3moe-sync:   the same model and routing through a sync-inducing dispatch: per expert `torch.where(mask[e])`
                   (a nonzero: the host reads each expert's row count), gather, expert MLP, index_add_, as
                   Megatron-style and hand-written MoE code does. Variants with dynamic_padding off / max /
                   buckets.
  llama8b-decode-b1 / -b8 / -b32: an 8B-shaped slice of Llama (hidden 4096, 8 layers, GQA 32/8, MLP 14336,
                   vocab 128256), one greedy decode step under no_grad with transformers' StaticCache after an
                   eager prefill of a 512-token prompt, new tokens every step; layer and block inference scope.
  llama8b-decode-varying: the same step with a batch that changes every step (a fixed sequence over 8 sizes in
                   1..32, one StaticCache per size, as a server's batch slots), capture_sizes 1, 2, 4, ..., 32.

--cpu-smoke builds every one at a tiny size (hidden 32, 1 layer, 16 tokens), float32, on the CPU: the plumbing.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.hf (the sync dispatch)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the configs below are complete: never reach the hub

import torch  # noqa: E402

from gpu_harness import Workload  # noqa: E402

TRAIN_VARIANTS = ("eager", "inductor", "reduce-overhead", "cg-local-eager", "cg-local-inductor", "cg-full-iteration")
SYNC_VARIANTS = ("eager", "inductor", "reduce-overhead", "cg-local-eager+off", "cg-local-eager+max",
                 "cg-local-eager+buckets", "cg-local-inductor+max", "cg-full-iteration+max")
DECODE_VARIANTS = ("eager", "inductor", "reduce-overhead", "cg-local-eager+layer", "cg-local-eager+block",
                   "cg-local-inductor+block", "cg-full-iteration")
VARYING_VARIANTS = ("eager", "inductor", "reduce-overhead", "cg-local-eager+block", "cg-local-eager+block+sizes",
                    "cg-local-inductor+block+sizes")
DECODE_BATCHES = (1, 8, 32)
VARYING_SIZES = (1, 3, 5, 8, 12, 17, 24, 32)  # the varying decode's batches (one StaticCache each)
MODELS = ("llama8b-decode-b1", "qwen3moe-sync", "llama-train", "qwen3moe-train", "llama8b-decode-b8",
          "llama8b-decode-b32", "llama8b-decode-varying")


@dataclasses.dataclass
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq: int  # training tokens per sequence; decode: the prompt
    experts: int = 0
    top_k: int = 0
    expert_width: int = 0
    positions: int = 64  # decode: cache positions after the prompt the steps cycle through


FULL = {
    "llama": Size(hidden=2048, layers=16, heads=16, kv_heads=4, intermediate=5632, vocab=32000, seq=2048),
    "qwen3moe": Size(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=3072, vocab=32000, seq=1024,
                     experts=64, top_k=8, expert_width=512),
    "llama8b": Size(hidden=4096, layers=8, heads=32, kv_heads=8, intermediate=14336, vocab=128256, seq=512),
}
SMOKE = {
    "llama": Size(hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, vocab=64, seq=16),
    "qwen3moe": Size(hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, vocab=64, seq=16,
                     experts=4, top_k=2, expert_width=16),
    "llama8b": Size(hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, vocab=64, seq=8, positions=8),
}


def transformers_or_raise():
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError("transformers is not installed") from exc
    return transformers


def build_model(family: str, size: Size, dtype, device, experts_implementation: Optional[str] = None):
    """A freshly initialised causal LM (seed 0) from a config in code, SDPA attention."""
    transformers = transformers_or_raise()
    common = dict(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                  num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                  max_position_embeddings=max(4096, size.seq + size.positions), tie_word_embeddings=False)
    if family == "qwen3moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=size.experts, num_experts_per_tok=size.top_k,
                                             moe_intermediate_size=size.expert_width,
                                             head_dim=size.hidden // size.heads, norm_topk_prob=True)
    else:
        config = transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    kwargs = {"experts_implementation": experts_implementation} if experts_implementation else {}
    with torch.device(device):  # initialised where it runs: an 8B-shaped slice need not pass through host memory
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=dtype, **kwargs)
    return model


def sync_experts_forward():
    """The sync-inducing expert dispatch over transformers 5's 3-D expert weights: a fixed loop over the experts,
    each selecting its rows with torch.where(mask[e]) (a nonzero: its row count read on the host), gather, expert
    MLP, index_add_. The same function tests/hf/test_hf_loop_experts.py checks against eager."""
    from tests.hf.test_hf_loop_experts import loop_forward

    return loop_forward


def _snapshot(model) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _restore(model, snapshot) -> None:
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(snapshot[k])


def sized(family: str, smoke: bool, layers: Optional[int]) -> Size:
    size = (SMOKE if smoke else FULL)[family]
    return dataclasses.replace(size, layers=layers) if layers else size


def train_workload(name: str, smoke: bool, device, dtype, pool: int = 16, layers: Optional[int] = None) -> Workload:
    """llama-train, qwen3moe-train, qwen3moe-sync: forward, loss, backward, AdamW step, grads to None, on a new
    batch of tokens every step (a pool built on the device up front, cycled)."""
    family = "llama" if name.startswith("llama") else "qwen3moe"
    size = sized(family, smoke, layers)
    sync = name == "qwen3moe-sync"
    if smoke and family == "qwen3moe" and not sync:
        dtype = torch.bfloat16  # float32 grouped_mm reads offsets on the host (transformers' fallback): bf16 as on a GPU
    model = build_model(family, size, dtype, device,
                        experts_implementation=("eager" if sync else "grouped_mm") if family == "qwen3moe" else None)
    if sync:
        forward = sync_experts_forward()
        for layer in model.model.layers:
            layer.mlp.experts.forward = types.MethodType(forward, layer.mlp.experts)
    model.train()
    snapshot = _snapshot(model)
    g = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, size.vocab, (1, size.seq), generator=g).to(device) for _ in range(pool)]
    state: dict = {"i": 0, "opt": None}

    def reset():
        _restore(model, snapshot)
        model.zero_grad(set_to_none=True)
        state["i"] = 0
        state["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-4)  # fresh state: created at its first step

    reset()

    def make_step(fn: Callable):
        def step():
            ids = batches[state["i"] % len(batches)]
            state["i"] += 1
            loss = fn(input_ids=ids, labels=ids).loss
            loss.backward()
            state["opt"].step()
            state["opt"].zero_grad(set_to_none=True)
            return loss.detach()
        return step

    dt = str(dtype).replace("torch.", "")
    if family == "llama":
        what = (f"LlamaForCausalLM hidden {size.hidden}, {size.layers} layers, GQA {size.heads}/{size.kv_heads}, "
                f"MLP {size.intermediate}")
    else:
        what = (f"Qwen3MoeForCausalLM hidden {size.hidden}, {size.layers} layers, {size.experts} experts "
                f"top-{size.top_k}, expert width {size.expert_width}, "
                + ("sync dispatch (torch.where(mask[e]) per expert)" if sync else "grouped_mm experts"))
    title = (f"{name}: training step (fwd+bwd+AdamW), {what}, {dt}, tokens (1, {size.seq}), new tokens every step "
             f"(pool of {pool})")
    flags = {"capture_dynamic_output_shape_ops": True} if sync else {}
    return Workload(name, title, model, make_step, {}, flags, paddable=sync, settle_steps=3,
                    variants=SYNC_VARIANTS if sync else TRAIN_VARIANTS, reset=reset, check=True,
                    check_tol=1e-3 if dtype == torch.float32 else 5e-2, training=True)


def decode_workload(name: str, smoke: bool, device, dtype, layers: Optional[int] = None) -> Workload:
    """llama8b-decode-b{1,8,32} and llama8b-decode-varying: one greedy-decode step with StaticCache under no_grad,
    new tokens every step, positions cycling through `positions` slots after the eager prefill."""
    transformers = transformers_or_raise()
    size = sized("llama8b", smoke, layers)
    varying = name.endswith("varying")
    batches = list(VARYING_SIZES) if varying else [int(name.rsplit("-b", 1)[1])]
    if smoke and varying:
        batches = [1, 3]  # 3 pads to capture size 4
    model = build_model("llama8b", size, dtype, device).eval()
    max_len = size.seq + size.positions + 1
    caches = {b: transformers.StaticCache(config=model.config, max_cache_len=max_len) for b in batches}
    g = torch.Generator().manual_seed(7)
    prompts = {b: torch.randint(0, size.vocab, (b, size.seq), generator=g).to(device) for b in batches}
    sequence: List[int] = batches * 8
    if varying:
        order = torch.randint(0, len(batches), (64,), generator=g).tolist()
        sequence = [batches[k] for k in order]
    tokens = [torch.randint(0, size.vocab, (b, 1), generator=g).to(device) for b in sequence]
    positions = [torch.tensor([size.seq + k], device=device) for k in range(size.positions)]
    state = {"i": 0, "at": {}}  # at: per cache, how many decode steps since its prefill (mod positions)

    def reset():
        state["i"], state["at"] = 0, {b: 0 for b in batches}
        with torch.no_grad():
            for b, cache in caches.items():
                cache.reset()
                model(input_ids=prompts[b], past_key_values=cache, use_cache=True,
                      cache_position=torch.arange(size.seq, device=device))

    reset()

    def make_step(fn: Callable):
        def step():
            i = state["i"]
            state["i"] = i + 1
            ids = tokens[i % len(tokens)]
            b = ids.shape[0]
            k = state["at"][b]
            state["at"][b] = (k + 1) % len(positions)
            if k == 0:  # the first slot after the prompt (again): rewind the cache's length
                for layer in caches[b].layers:  # (transformers 5 counts it on the device, a tensor updated in place)
                    layer.cumulative_length.fill_(size.seq)
            position = positions[k]
            with torch.no_grad():
                out = fn(input_ids=ids, past_key_values=caches[b], use_cache=True,
                         cache_position=position, position_ids=position.expand(b, 1))
            return out.logits
        return step

    dt = str(dtype).replace("torch.", "")
    kind = f"batch changing every step over {batches}" if varying else f"batch {batches[0]}"
    title = (f"{name}: greedy decode step (no_grad), Llama hidden {size.hidden}, {size.layers} layers, GQA "
             f"{size.heads}/{size.kv_heads}, MLP {size.intermediate}, vocab {size.vocab}, {dt}, StaticCache, "
             f"prompt {size.seq}, {kind}, new tokens every step")
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64) if s < max(batches)] + [max(batches)]
    return Workload(name, title, model, make_step, {}, {"recompile_limit": 64} if varying else {},
                    capture_sizes=sizes if varying else None, settle_steps=len(tokens) if varying else 3,
                    variants=VARYING_VARIANTS if varying else DECODE_VARIANTS, reset=reset, check=True,
                    check_tol=1e-3 if dtype == torch.float32 else 5e-2, scoped=True)


def build(name: str, smoke: bool, device, dtype, layers: Optional[int] = None) -> Workload:
    """The workload `name` at its full size (smoke: tiny); `layers` overrides the depth (a budget's compromise:
    the 64-expert sync loop is unrolled by Dynamo, about 8 s of tracing per layer on a small CPU)."""
    if name.startswith("llama8b-decode"):
        return decode_workload(name, smoke, device, dtype, layers)
    return train_workload(name, smoke, device, dtype, layers=layers)

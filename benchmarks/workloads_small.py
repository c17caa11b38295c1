"""The small, launch-bound workloads of bench_gpu.py (d=512 or less, 8 layers, 128 tokens): where per-kernel
launch overhead shows. moe / moe-fixed / mixtral: the tests' MoE models, training step; decode /
decode-varying: the tests' KV-cache GPT; hf-mixtral: a small transformers Mixtral (benchmarks/hf_moe.py).
Sizes come from bench_gpu.py's arguments (--layers, --d-model, ...)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.models
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for hf_moe

import torch  # noqa: E402

import hf_moe  # noqa: E402
from gpu_harness import Workload  # noqa: E402
from tests.models import MODELS as TEST_MODELS  # noqa: E402
from tests.models import kv_gpt  # noqa: E402

MODELS = ("moe", "moe-fixed", "mixtral", "decode", "decode-varying", "hf-mixtral")


def moe_workload(args, device, dtype, name: str = "moe") -> Workload:
    """A MoE training step. "moe" / "moe-fixed": tests/models/moe.py (mask dispatch), new tokens every step /
    one batch; "mixtral": the HF-style tests/models/mixtral.py, new tokens every step. The spec in
    tests/models supplies build + tags, the loss, the recommended modules and the Dynamo flags."""
    spec = TEST_MODELS["mixtral" if name == "mixtral" else "moe_mask"]
    sizes = dict(num_layers=args.layers, n_heads=args.heads, num_experts=args.experts, top_k=2)
    sizes["hidden" if name == "mixtral" else "d_model"] = args.d_model
    model = spec.make(**sizes).to(device=device, dtype=dtype)
    varying = name != "moe-fixed"
    pool = [spec.example_inputs(batch=args.batch, seq=args.seq, seed=seed, device=device)[0]
            for seed in range(args.token_pool if varying else 1)]

    def make_step(fn):
        state = {"i": 0}  # per variant: every variant sees the same sequence of batches

        def step():
            tokens = pool[state["i"] % len(pool)]
            state["i"] += 1
            spec.loss(fn, tokens).backward()
            model.zero_grad(set_to_none=True)
        return step

    what = ("Mixtral-style sparse MoE block (float softmax router, top-2, torch.where(expert_mask[e]) loop)"
            if name == "mixtral" else "mask dispatch")
    feed = f"new tokens every step (pool of {len(pool)} batches)" if varying else "the same tokens every step"
    title = (f"{name}: training step (fwd+bwd), {args.layers} layers, d={args.d_model}, {args.experts} experts "
             f"top-2, {str(dtype).replace('torch.', '')}, tokens ({args.batch}, {args.seq}), {feed}, {what}")
    return Workload(name, title, model, make_step, spec.options(), spec.dynamo_flags(), paddable=True,
                    settle_steps=max(3, len(pool)))


def hf_workload(args, device, dtype) -> Workload:
    """A Hugging Face transformers Mixtral (benchmarks/hf_moe.py) training step, transformers' default experts
    implementation (grouped_mm: no host read), new tokens every step; cuda_graph_modules=[] captures each
    decoder layer whole."""
    model = hf_moe.build(layers=args.layers, hidden=args.d_model, experts=args.experts, heads=args.heads,
                         dtype=dtype, device=device)
    if model is None:
        raise RuntimeError("transformers is not installed")

    def make_step(fn):  # per variant: every variant sees the same sequence of batches
        return hf_moe.make_step(model, fn, args.batch, args.seq, device, pool=args.token_pool)

    title = (f"hf-mixtral: transformers MixtralForCausalLM training step (fwd+bwd), {args.layers} layers, "
             f"d={args.d_model}, {args.experts} experts top-2, {str(dtype).replace('torch.', '')}, tokens "
             f"({args.batch}, {args.seq}), new tokens every step, default experts implementation")
    return Workload("hf-mixtral", title, model, make_step, {"cuda_graph_modules": []}, {},
                    settle_steps=max(3, args.token_pool))


def decode_workload(args, device, dtype, varying: bool = False) -> Workload:
    """Greedy decode with a static KV cache (tests/models/kv_gpt.py): prefill eagerly, then time decode steps.
    Positions cycle through the cache after the prompt. varying=True: the batch changes every step (a fixed
    pseudo-random sequence over 1..--max-batch, fresh token tensors, as a server builds each step's batch)."""
    max_batch = args.max_batch if varying else args.batch
    model = kv_gpt.build(num_layers=args.layers, d_model=args.d_model, n_heads=args.heads, max_batch=max_batch,
                         max_seq=args.seq + args.decode_positions).to(device=device, dtype=dtype).eval()
    module = kv_gpt.DecodeStep(model)
    (prompt,) = kv_gpt.example_inputs(batch=max_batch, seq=args.seq, device=device)
    first = kv_gpt.prefill(model, prompt)
    positions = kv_gpt.positions(model.max_seq, device)
    batches = [max_batch] * 16
    if varying:
        g = torch.Generator().manual_seed(0)
        batches = [int(b) + 1 for b in torch.randint(0, max_batch, (64,), generator=g)]
    tokens = [first[:b].clone() for b in batches]
    state = {"i": 0}

    def make_step(fn):
        def step():
            i = state["i"]
            state["i"] = i + 1
            with torch.no_grad():
                fn(tokens[i % len(tokens)], positions[args.seq + i % args.decode_positions])
        return step

    kind = f"batch changing every step (1..{max_batch})" if varying else f"batch {max_batch}"
    title = (f"{'decode-varying' if varying else 'decode'}: greedy KV-cache decode step (no_grad), {args.layers} "
             f"layers, d={args.d_model}, {str(dtype).replace('torch.', '')}, {kind}, prompt {args.seq}")
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64, 128) if s < max_batch] + [max_batch]
    return Workload("decode-varying" if varying else "decode", title, module, make_step,
                    {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"],
                     "inference_cuda_graph_scope": "block"}, {}, capture_sizes=sizes)


BUILDERS = {"moe": moe_workload, "moe-fixed": lambda *a: moe_workload(*a, name="moe-fixed"),
            "mixtral": lambda *a: moe_workload(*a, name="mixtral"), "decode": decode_workload,
            "decode-varying": lambda *a: decode_workload(*a, varying=True), "hf-mixtral": hf_workload}

"""Greedy decoding with the tiny dense GPT under torch.no_grad: the inference plan, tokens/s, and eager parity.

Inference graphs follow `inference_cuda_graph_scope`: "layer" captures the tagged attn/mlp regions of each
layer (one graph per layer after glue absorption), "block" captures maximal capture-safe spans across layers
(here the whole decode step: one graph). The tiny model has no KV cache, so each step re-reads a fixed window
of the last `--window` tokens: the shapes never change, which is what CUDA graphs need (a growing sequence
would capture one graph per length).

On a machine without a GPU, driver "auto" runs eagerly and the plan marks what would be captured; on a GPU the
captured partitions replay as CUDA graphs. Tokens/s is measured after warmup, so it excludes compile time.

    python examples/infer_gpt.py --scope block
    python examples/infer_gpt.py --scope layer --tokens 16 --driver emulate
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.models

import torch  # noqa: E402

import cgcompile  # noqa: E402
from tests.models import MAX_SEQ, MODELS  # noqa: E402
from tests.models.dense_gpt import GreedyStep  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode(step, window: torch.Tensor, n: int) -> torch.Tensor:
    out = []
    for _ in range(n):
        window, token = step(window)
        out.append(token)
    return torch.cat(out, dim=1)


def tokens_per_s(step, window: torch.Tensor, n: int, device: str, repeats: int = 3) -> float:
    """Median over a few timed runs: one run on a busy host can be off by a lot."""
    rates = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        decode(step, window, n)
        sync(device)
        rates.append(window.shape[0] * n / (time.perf_counter() - start))
    return statistics.median(rates)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scope", choices=("layer", "block"), default="layer",
                        help="inference_cuda_graph_scope")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence in the timed run")
    parser.add_argument("--driver", default="auto", help="auto | cuda | emulate | eager")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--html", default="", help="also write the visual plan to this file")
    args = parser.parse_args(argv)
    if not 1 < args.window <= MAX_SEQ:
        parser.error(f"--window must be in 2..{MAX_SEQ} (the model's position table)")

    spec = MODELS["dense_gpt"]
    model = spec.make(num_layers=args.layers, d_model=args.d_model).to(args.device).eval()
    step = GreedyStep(model)
    (prompt,) = spec.example_inputs(batch=args.batch, seq=args.window, device=args.device)
    options = spec.options(inference_cuda_graph_scope=args.scope, driver=args.driver)
    print(f"device: {args.device}, torch {torch.__version__}; options: {options}\n")

    with torch.no_grad():
        plan = cgcompile.explain(step, prompt, options=options)
        print(plan, "\n")
        if args.html:
            plan.to_html(args.html)
            print(f"visual plan written to {args.html}\n")

        compiled = torch.compile(step, backend="cudagraph_modules", options=options)
        warmup = cgcompile.CudaGraphConfig.from_options(options).cuda_graph_warmup_steps + 2
        sync(args.device)
        start = time.perf_counter()
        decode(compiled, prompt, warmup)  # compile, warm up, capture
        sync(args.device)
        print(f"compile + warmup + capture ({warmup} steps): {time.perf_counter() - start:.2f} s")

        same = torch.equal(decode(compiled, prompt, args.tokens), decode(step, prompt, args.tokens))
        eager_tps = tokens_per_s(step, prompt, args.tokens, args.device)
        compiled_tps = tokens_per_s(compiled, prompt, args.tokens, args.device)
    print(f"greedy tokens identical to eager: {same}")
    print(f"eager:     {eager_tps:10.1f} tokens/s")
    print(f"cgcompile: {compiled_tps:10.1f} tokens/s ({compiled_tps / eager_tps:.2f}x eager; "
          f"scope={args.scope}, batch={args.batch}, {args.tokens} tokens each)")
    stats = getattr(cgcompile, "stats", None)  # runtime counters: graphs captured, replays, eager fallbacks
    if callable(stats):
        print(f"stats: {stats()}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""Greedy decoding with the tiny KV-cache GPT under torch.no_grad: the inference plan, tokens/s, eager parity.

The model (tests/models/kv_gpt.py) keeps a static key/value cache in module buffers and writes each step's
keys/values in place at a position given as a tensor (gpt-fast style), so a decode step has fixed shapes and
no host sync: the prompt is prefilled eagerly, then every decode step replays the captured graph(s).
Inference graphs follow `inference_cuda_graph_scope`: "layer" captures the tagged attn/mlp regions of each
layer (one graph per layer after glue absorption), "block" captures maximal capture-safe spans across layers
(here the whole decode step: one graph). `--capture-sizes 1,2,4` with `--batch 3` shows batch padding: the
batch is padded to the next listed size and the outputs sliced back.

On a machine without a GPU, driver "auto" runs eagerly and the plan marks what would be captured; on a GPU the
captured partitions replay as CUDA graphs. Tokens/s is measured after warmup, so it excludes compile time.

    python examples/infer_gpt.py --scope block
    python examples/infer_gpt.py --scope layer --tokens 16 --driver emulate
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.models

import torch  # noqa: E402

import cgcompile  # noqa: E402
from tests.models import kv_gpt  # noqa: E402

PROMPT = 8


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def tokens_per_s(step, model, prompt: torch.Tensor, n: int, device: str, repeats: int = 3) -> float:
    """Median over a few timed runs (prefill + n decode steps each): one run on a busy host can be off by a lot."""
    rates = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        kv_gpt.generate(step, model, prompt, n)
        sync(device)
        rates.append(prompt.shape[0] * n / (time.perf_counter() - start))
    return statistics.median(rates)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scope", choices=("layer", "block"), default="layer",
                        help="inference_cuda_graph_scope")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence in the timed run")
    parser.add_argument("--capture-sizes", default="", help="comma-separated batch sizes (option capture_sizes)")
    parser.add_argument("--driver", default="auto", help="auto | cuda | emulate | eager")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--html", default="", help="also write the visual plan to this file")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.capture_sizes.split(",") if s.strip()]
    max_batch = max([args.batch] + sizes)
    model = kv_gpt.build(num_layers=args.layers, d_model=args.d_model, max_batch=max_batch,
                         max_seq=PROMPT + args.tokens + 1).to(args.device).eval()
    reference = copy.deepcopy(model)
    step = kv_gpt.DecodeStep(model)
    (prompt,) = kv_gpt.example_inputs(batch=args.batch, seq=PROMPT, device=args.device)
    options = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"],
               "inference_cuda_graph_scope": args.scope, "driver": args.driver}
    if sizes:
        options["capture_sizes"] = sizes
    print(f"device: {args.device}, torch {torch.__version__}; options: {options}\n")

    with torch.no_grad():
        token = kv_gpt.prefill(model, prompt)
        if sizes:
            torch._dynamo.mark_dynamic(token, 0)  # a serving batch: let Dynamo make it symbolic from the start
        plan = cgcompile.explain(step, token, kv_gpt.positions(model.max_seq)[PROMPT], options=options)
        print(plan, "\n")
        if args.html:
            plan.to_html(args.html)
            print(f"visual plan written to {args.html}\n")

        compiled = torch.compile(step, backend="cudagraph_modules", options=options, dynamic=True if sizes else None)
        warmup = cgcompile.CudaGraphConfig.from_options(options).cuda_graph_warmup_steps + 2
        sync(args.device)
        start = time.perf_counter()
        kv_gpt.generate(compiled, model, prompt, warmup)  # compile, warm up, capture
        sync(args.device)
        print(f"compile + warmup + capture ({warmup} steps): {time.perf_counter() - start:.2f} s")

        got = kv_gpt.generate(compiled, model, prompt, args.tokens)
        same = torch.equal(got, kv_gpt.generate(kv_gpt.DecodeStep(reference), reference, prompt, args.tokens))
        eager_tps = tokens_per_s(kv_gpt.DecodeStep(reference), reference, prompt, args.tokens, args.device)
        compiled_tps = tokens_per_s(compiled, model, prompt, args.tokens, args.device)
    print(f"greedy tokens identical to eager: {same}")
    print(f"eager:     {eager_tps:10.1f} tokens/s")
    print(f"cgcompile: {compiled_tps:10.1f} tokens/s ({compiled_tps / eager_tps:.2f}x eager; "
          f"scope={args.scope}, batch={args.batch}, {args.tokens} tokens each)")
    print(f"stats: {cgcompile.stats()}")  # runtime counters: graphs captured, replays, eager fallbacks
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""Train the tiny Mixtral-like MoE with the cudagraph_modules backend: the plan, then the loss going down.

The model is tests/models/moe.py, whose classes carry their tags by decorator:
`@cgcompile.tag("attn")` on SelfAttention, `"moe_router"` on Router, `"moe_preprocess"` on MoEPreprocess (and
`"moe"` on the MoE block). We capture attn + moe_router + moe_preprocess, Megatron's recipe for MoE models:
the expert dispatch (torch.nonzero per expert) has data-dependent shapes, so it stays an eager island and the
plan names the op and its line. The synthetic task (each token is followed by a fixed random successor) is
learnable, so the loss should fall from about ln(64) ~ 4.2 towards 0.

On a machine without a GPU, driver "auto" runs every partition eagerly (the plan says what would be captured);
`--driver emulate` runs the CPU emulation of capture and replay. On a GPU the captured partitions replay as
CUDA graphs after `cuda_graph_warmup_steps` eager steps.

    python examples/train_moe.py                  # 300 steps
    python examples/train_moe.py --steps 20 --driver emulate
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.models

import torch  # noqa: E402

import cgcompile  # noqa: E402
from tests.models import MODELS, VOCAB  # noqa: E402


def synthetic_batches(batch: int, seq: int, device, seed: int = 0):
    """Endless batches of sequences that follow one fixed random successor table: learnable, no downloads."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(VOCAB, generator=g)
    while True:
        tokens = torch.empty(batch, seq, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
        for t in range(1, seq):
            tokens[:, t] = successor[tokens[:, t - 1]]
        yield tokens.to(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--driver", default="auto", help="auto | cuda | emulate | eager")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--html", default="", help="also write the visual plan to this file")
    args = parser.parse_args(argv)

    spec = MODELS["moe_mask"]
    model = spec.make(num_layers=args.layers).to(args.device)
    tags = sorted({cgcompile.tag_of(m) for m in model.modules()} - {None})
    options = spec.options(driver=args.driver)
    print(f"device: {args.device}, torch {torch.__version__}; module tags in the model: {tags}")
    print(f"options: {options}\n")
    data = synthetic_batches(args.batch, args.seq, args.device)

    # torch.nonzero in the dispatch: this Dynamo flag keeps it in the graph as an eager island instead of a
    # Dynamo graph break per expert.
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        plan = cgcompile.explain(model, next(data), options=options)
        print(plan, "\n")
        if args.html:
            plan.to_html(args.html)
            print(f"visual plan written to {args.html}\n")

        compiled = torch.compile(model, backend="cudagraph_modules", options=options)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        first = last = None
        start = time.perf_counter()
        for step in range(args.steps):
            loss = spec.loss(compiled, next(data))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % args.log_every == 0 or step == args.steps - 1:
                last = loss.item()  # a host sync: only when printing
                first = last if first is None else first
                print(f"step {step:4d}/{args.steps}  loss {last:.4f}")
        elapsed = time.perf_counter() - start
    print(f"\nloss {first:.4f} -> {last:.4f} in {args.steps} steps ({elapsed:.1f} s, first step includes compile)")
    stats = getattr(cgcompile, "stats", None)  # runtime counters: graphs captured, replays, eager fallbacks
    if callable(stats):
        print(f"stats: {stats()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make demo`: compile a tiny MoE transformer with the cudagraph_modules backend, train a few steps, print the plan.

On a machine without a GPU it runs every partition eagerly and the plan says what would be captured; pass
`--driver emulate` to exercise the capture/replay buffer logic on the CPU, and `--dynamic-padding buckets` (or
`max`) to capture the experts too (docs/guides/moe-dynamic-padding.md).
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys

import torch

import cgcompile
from cgcompile.examples import moe


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--driver", default="auto", help="auto | cuda | emulate | eager")
    parser.add_argument("--dynamic-padding", default="off", choices=("off", "max", "buckets"),
                        help="max or buckets: capture the expert loop too")
    parser.add_argument("--html", default="cgcompile_plan.html", help="where to write the visual plan ('' to skip)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the backend's INFO lines")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = moe.build(num_layers=args.layers, dispatch="mask").to(device)
    reference = copy.deepcopy(model)
    (tokens,) = moe.example_inputs(device=device)
    options = {"cuda_graph_impl": "local", "cuda_graph_modules": list(moe.CUDA_GRAPH_MODULES), "driver": args.driver}
    if args.dynamic_padding != "off":  # the expert loop is untagged: capture every capture-safe span
        options.update(cuda_graph_modules=[], dynamic_padding=args.dynamic_padding)
    print(f"options: {options}")
    print(f"normalized: {cgcompile.CudaGraphConfig.from_options(options).to_options()}\n")

    # The mask dispatch uses torch.nonzero; this (user-side, explicit) Dynamo flag keeps it inside the graph
    # as an eager island instead of a graph break per expert.
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        plan = cgcompile.explain(model, tokens, options=options)
        print(plan, "\n")
        if args.html:
            plan.to_html(args.html)
            print(f"visual plan written to {args.html}\n")
        compiled = torch.compile(model, backend="cudagraph_modules", options=options)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(args.steps):
            loss = moe.loss(compiled, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref_loss = moe.loss(reference, tokens)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            print(f"step {step}: loss {loss.item():.6f} (eager {ref_loss.item():.6f})")
    st = cgcompile.stats()
    print(f"\ngraphs captured: {st['graphs_captured']}, replays: {st['replays']}, "
          f"eager fallbacks: {len(st['eager_fallbacks'])}")
    if st["graphs_captured"] == 0:
        print("nothing was captured: on a CPU driver=auto runs every partition eagerly; the plan above shows what "
              "a GPU would capture. `python -m cgcompile.demo --driver emulate` exercises capture and replay on "
              "the CPU.")
    if args.dynamic_padding == "off":
        print("the experts' islands stay eager (their rows are data-dependent); `python -m cgcompile.demo "
              "--dynamic-padding buckets` (or max) pads them exactly and captures them too.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train a tiny Hugging Face Mixtral (random weights, config built in code, no download) through cgcompile:
print the plan, check every step's loss against eager, and show what was captured.

    python examples/hf_moe_train.py [--steps 4] [--bf16]

With fp32 weights transformers' grouped-mm experts run its fallback op, which reads the expert offsets on the
host: the plan keeps that op eager and names its line. With --bf16 transformers calls torch._grouped_mm and
each decoder layer is one captured graph.
"""

import argparse
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import cgcompile  # noqa: E402
from cgcompile.backend import record_plans  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if args.bf16:
        model = model.to(torch.bfloat16)
    print("tagged:", cgcompile.tag_hf(model))
    reference = copy.deepcopy(model)
    options = {"driver": "emulate", "cuda_graph_modules": []}  # on a GPU: driver "cuda" (or the default, auto)
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    with record_plans() as rec:
        for step in range(args.steps):
            ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            loss, ref = compiled(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
            loss.backward()
            ref.backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            print(f"step {step}: loss {loss.item():.6f} eager {ref.item():.6f} equal {bool(loss == ref)}")
    print(cgcompile.Plan(cgcompile.CudaGraphConfig.from_options(options), rec.graphs))
    stats = cgcompile.stats()
    print(f"graphs captured {stats['graphs_captured']}, replays {stats['replays']}, "
          f"eager fallbacks {len(stats['eager_fallbacks'])}")


if __name__ == "__main__":
    main()

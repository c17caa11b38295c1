"""Greedy decode of a tiny Hugging Face Llama (random weights, config built in code, no download) with a
StaticCache, each decode step through cgcompile; the tokens are compared with eager.

    python examples/hf_generate.py [--tokens 9] [--scope block] [--capture-sizes 1,2,4 --batch 3]
"""

import argparse
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import cgcompile  # noqa: E402


def greedy(model, step_fn, prompt, steps):
    batch, length = prompt.shape
    cache = transformers.StaticCache(config=model.config, max_cache_len=length + steps + 1)
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(length))
        tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
        for i in range(steps - 1):
            position = torch.tensor([length + i])
            out = step_fn(input_ids=tokens[-1], past_key_values=cache, use_cache=True, cache_position=position,
                          position_ids=position.expand(batch, 1))
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=9)
    parser.add_argument("--scope", choices=["layer", "block"], default="block")
    parser.add_argument("--capture-sizes", default="")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference = copy.deepcopy(model)
    sizes = [int(s) for s in args.capture_sizes.split(",") if s]
    compiled = torch.compile(model, backend="cudagraph_modules", options={
        "driver": "emulate", "inference_cuda_graph_scope": args.scope, "capture_sizes": sizes})
    prompt = torch.randint(0, 64, (args.batch, 5), generator=torch.Generator().manual_seed(0))
    got = greedy(model, compiled, prompt, args.tokens)
    want = greedy(reference, reference, prompt, args.tokens)
    print("tokens:", got.tolist())
    print("greedy tokens identical to eager:", torch.equal(got, want))
    stats = cgcompile.stats()
    print(f"graphs captured {stats['graphs_captured']}, replays {stats['replays']}, "
          f"eager fallbacks {len(stats['eager_fallbacks'])}")


if __name__ == "__main__":
    main()

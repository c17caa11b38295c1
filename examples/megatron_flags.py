"""Megatron-LM's CUDA-graph flags, normalized as Megatron-Core 0.19.2 does: each input, its warning, the config.

cgcompile accepts the options Megatron users already have in their configs and gives them the meaning
Megatron-Core 0.19.2's TransformerConfig gives them (docs/guides/megatron.md lists where it is deliberately
friendlier). The old spellings (`enable_cuda_graph`, `external_cuda_graph`, `cuda_graph_scope`,
the scope values `full`, `full_iteration`, `full_iteration_inference`) are rewritten to the current vocabulary
(`cuda_graph_impl`, `cuda_graph_modules`, `inference_cuda_graph_scope`), each with one FutureWarning; every
rewrite, also the local impl's silent moe_router/moe_preprocess pairing, is recorded in `config.migrations`.
Contradictory combinations raise one ConfigError that names the fix. No model, no device: this is pure option
normalization (cgcompile/megatron_flags.py), so it runs the same on CPU and GPU.

    python examples/megatron_flags.py
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import cgcompile  # noqa: E402

# The migrations of Megatron-LM's CUDA-graph docs, Megatron-Core 0.19.2's own rules, then two inputs it rejects.
CASES = [
    {"enable_cuda_graph": True},
    {"external_cuda_graph": True},
    {"cuda_graph_scope": ["attn", "moe_router"]},
    {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]},
    {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration_inference"]},
    {"cuda_graph_scope": ["attn", "moe_router", "moe_preprocess", "full_iteration_inference"]},
    {"cuda_graph_scope": "full"},
    {"enable_cuda_graph": True, "cuda_graph_scope": "attn,mlp"},
    # Megatron-Core 0.19.2: impl 'none' is its default, so the old flag still applies; no module rules under
    # 'none' (nothing is captured; the plan shows what would be); its default modules value "full"
    {"enable_cuda_graph": True, "cuda_graph_impl": "none"},
    {"cuda_graph_impl": "none", "cuda_graph_modules": ["moe", "moe_router"]},
    {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": "full"},
    # rejected: old and new spelling of one option; a Megatron rule (moe_preprocess needs moe_router, with
    # transformer_engine: the local impl selects the pair)
    {"cuda_graph_scope": ["attn"], "cuda_graph_modules": ["mlp"]},
    {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "moe_preprocess"]},
]


def show(options: dict) -> bool:
    """Normalize one option dict and print what happened; returns False when it was rejected."""
    print(f"input:      {options}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = cgcompile.CudaGraphConfig.from_options(options)
        except cgcompile.ConfigError as err:
            print(f"ConfigError: {err}\n")
            return False
    for w in caught:
        print(f"{w.category.__name__}: {w.message}")
    modules = [str(m) for m in config.cuda_graph_modules]
    print(f"normalized: cuda_graph_impl={config.cuda_graph_impl.value!r}, cuda_graph_modules={modules}, "
          f"inference_cuda_graph_scope={config.inference_cuda_graph_scope.value!r}")
    print(f"migrations: {[str(m) for m in config.migrations]}\n")
    return True


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    accepted = sum(show(case) for case in CASES)
    print(f"{accepted} accepted, {len(CASES) - accepted} rejected")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the parity cases through Megatron-Core's TransformerConfig and record what it does.

Needs Megatron-Core (Python >= 3.12) and torch; not collected by pytest (no ``test_`` prefix). The recorded
file is what tests/test_megatron_parity.py replays against cgcompile in the normal suite:

    python tests/megatron_oracle.py --write     # rewrites tests/data/megatron_core_<version>.json
    python tests/megatron_oracle.py             # prints the results

Each case builds ``TransformerConfig(**BASE, **options)``, so Megatron's ``__post_init__`` runs its CUDA-graph
migrations and checks. BASE is the smallest model that lets every module name be valid: two layers, one dense
and one MoE (drop-and-pad, so ``moe`` capture is allowed), so only option rules can reject a case and none of
Megatron's model-dependent rules (cgcompile checks those against the traced graph, at plan time).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.megatron_cases import cases, decode  # noqa: E402

BASE: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_moe_experts": 8,
    "moe_layer_freq": [0, 1],
    "moe_expert_capacity_factor": 1.0,
    "moe_pad_expert_input_to_capacity": True,
}
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
_CUDA_GRAPH_WORDS = ("cuda_graph", "cuda graph", "full scope")


def data_path(version: str) -> str:
    return os.path.join(DATA_DIR, f"megatron_core_{version.replace('.', '_')}.json")


def megatron_enums() -> dict[str, Any]:
    from megatron.core.transformer import enums
    return {name: getattr(enums, name) for name in ("CudaGraphModule", "CudaGraphScope", "InferenceCudaGraphScope")}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _about_cuda_graphs(message: str) -> bool:
    return any(word in message.lower() for word in _CUDA_GRAPH_WORDS)


def megatron_result(options: dict[str, Any]) -> dict[str, Any]:
    """One case through TransformerConfig: the normalized fields and the CUDA-graph warnings, or the error."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    handler = _Records()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config = TransformerConfig(**BASE, **options)
    except Exception as err:  # noqa: BLE001 - the error is the recorded outcome
        return {"accepted": False, "error": type(err).__name__, "message": str(err)}
    finally:
        root.removeHandler(handler)
    emitted = [f"{w.category.__name__}: {w.message}" for w in caught if _about_cuda_graphs(str(w.message))]
    emitted += [f"log: {m}" for m in handler.messages if _about_cuda_graphs(m)]
    return {
        "accepted": True,
        "cuda_graph_impl": config.cuda_graph_impl,
        "cuda_graph_modules": [m.name for m in config.cuda_graph_modules],
        "inference_cuda_graph_scope": config.inference_cuda_graph_scope.name,
        "warnings": emitted,
    }


def record() -> dict[str, Any]:
    import megatron.core
    import torch

    enum_classes = megatron_enums()
    results = []
    for case in cases():
        options = {name: decode(value, enum_classes) for name, value in case["options"].items()}
        results.append({**case, "megatron": megatron_result(options)})
    return {
        "megatron_core": megatron.core.__version__,
        "produced_by": "python tests/megatron_oracle.py --write (megatron-core installed from PyPI, "
                       f"Python {sys.version.split()[0]}, torch {torch.__version__}, CPU)",
        "how": "TransformerConfig(**base, **options): __post_init__ migrations and checks; warnings are the "
               "warnings.warn / logging messages about CUDA graphs emitted during construction",
        "base": BASE,
        "cases": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write tests/data/megatron_core_<version>.json")
    args = parser.parse_args(argv)
    data = record()
    text = json.dumps(data, indent=1) + "\n"
    if args.write:
        path = data_path(data["megatron_core"])
        os.makedirs(DATA_DIR, exist_ok=True)
        with open(path, "w") as out:
            out.write(text)
        accepted = sum(c["megatron"]["accepted"] for c in data["cases"])
        print(f"{path}: {len(data['cases'])} cases, {accepted} accepted by Megatron-Core {data['megatron_core']}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

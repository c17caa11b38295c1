"""Registry of the tiny test models.

    from tests.models import MODELS          # (or `from models import MODELS` with tests/ on sys.path)
    spec = MODELS["moe_mask"]
    model = spec.make(num_layers=2, seed=0)  # build + prepare (tags for hf_style)
    (tokens,) = spec.example_inputs(batch=2, seq=8, seed=0)
    spec.loss(model, tokens).backward()
    torch.compile(model, backend="cudagraph_modules", options=spec.options())

Every model takes int64 token ids (batch, seq) and returns logits (batch, seq, VOCAB); build() is deterministic
for a given seed and does not disturb the global RNG.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import Any, Callable

import torch.nn as nn

from . import dense_gpt, hf_style, kv_gpt, mamba, mixtral, moe
from ._common import MAX_SEQ, VOCAB

__all__ = ["MODELS", "ModelSpec", "VOCAB", "MAX_SEQ", "dense_gpt", "kv_gpt", "moe", "mamba", "hf_style", "mixtral"]


def _identity(model: nn.Module) -> nn.Module:
    return model


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One test model.

    name: registry key. module: the Python module defining it (e.g. for moe.dispatch_lines).
    build(num_layers=2, seed=0, **kw) -> nn.Module (untagged instances for hf_style).
    example_inputs(batch=2, seq=8, seed=0, device=None) -> (tokens,).
    loss(model, tokens) -> scalar next-token cross entropy.
    cuda_graph_modules: the recommended modules for the "local with modules" config.
    prepare(model) -> model: instance tagging needed before compile (tag_modules for hf_style; identity otherwise).
    dispatch: "mask" / "sort" for the MoE variants ("mask": index producers such as nonzero / torch.where(mask)
    stay in the graph), else None.
    """

    name: str
    module: ModuleType
    build: Callable[..., nn.Module]
    example_inputs: Callable[..., tuple]
    loss: Callable[..., Any]
    cuda_graph_modules: tuple[str, ...]
    prepare: Callable[[nn.Module], nn.Module] = _identity
    dispatch: str | None = None

    def make(self, num_layers: int = 2, seed: int = 0, **kw) -> nn.Module:
        """build() then prepare(): a model ready for torch.compile with the recommended modules."""
        return self.prepare(self.build(num_layers=num_layers, seed=seed, **kw))

    def dynamo_flags(self) -> dict:
        """Dynamo config the model is compiled under in tests: the mask dispatch keeps `nonzero` in the graph as
        an eager island; the others use the default flags (the sort dispatch then graph-breaks)."""
        return {"capture_dynamic_output_shape_ops": True} if self.dispatch == "mask" else {}

    def options(self, **overrides) -> dict:
        """Backend options for the "local with modules" config; overrides are merged in."""
        return {"cuda_graph_impl": "local", "cuda_graph_modules": list(self.cuda_graph_modules), **overrides}


def _spec(name, module, modules, **kw) -> ModelSpec:
    return ModelSpec(name=name, module=module, build=kw.pop("build", module.build),
                     example_inputs=module.example_inputs, loss=module.loss, cuda_graph_modules=tuple(modules), **kw)


MODELS: dict[str, ModelSpec] = {
    "dense_gpt": _spec("dense_gpt", dense_gpt, ["attn", "mlp"]),
    "moe_mask": _spec("moe_mask", moe, moe.CUDA_GRAPH_MODULES,
                      build=functools.partial(moe.build, dispatch="mask"), dispatch="mask"),
    "moe_sort": _spec("moe_sort", moe, moe.CUDA_GRAPH_MODULES,
                      build=functools.partial(moe.build, dispatch="sort"), dispatch="sort"),
    "mamba": _spec("mamba", mamba, ["mamba"]),
    "hf_style": _spec("hf_style", hf_style, ["attn", "mlp"], prepare=hf_style.prepare),
    "mixtral": _spec("mixtral", mixtral, ["attn", "moe_router"], prepare=mixtral.prepare, dispatch="mask"),
    "qwen_moe": _spec("qwen_moe", mixtral, ["attn", "moe_router"], prepare=mixtral.prepare, dispatch="mask",
                      build=functools.partial(mixtral.build, shared_expert=True)),
}

"""Tagging preset for Megatron-Core models, whose classes users do not decorate.

`cgcompile.tag_megatron(model)` tags each submodule by the role Megatron's `--cuda-graph-scope` names: a
TransformerLayer's `self_attention` "attn", its dense `mlp` "mlp", the MoE layer "moe", its router "moe_router",
the Mamba mixer "mamba". Then `cuda_graph_modules=["attn", "moe_router"]` captures what Megatron's partial CUDA
graphs capture. Instances are tagged (Megatron's classes stay untouched). Nothing here imports megatron: roles
are read from the class names in each module's class hierarchy, among classes defined under `megatron.`, so a
subclass (MLASelfAttention, a custom router) is tagged as its base.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch.nn as nn

from .errors import ConfigError
from .tagging import tag

__all__ = ["MEGATRON_ROLES", "megatron_role", "tag_megatron"]

# Megatron-Core class (or base class) name -> tag, for modules wherever they sit
MEGATRON_ROLES: Dict[str, str] = {"TopKRouter": "moe_router", "Router": "moe_router", "BaseMoELayer": "moe",
                                  "MambaMixer": "mamba"}
_LAYERS = ("TransformerLayer", "BaseTransformerLayer")  # whose self_attention / mlp are tagged by position
_ABSENT = ("IdentityOp", "IdentityFuncOp")  # what a layer spec puts where it has no such submodule


def _megatron_classes(module: nn.Module) -> list:
    """The names of the module's classes (its own and its bases) defined in Megatron-Core."""
    return _megatron_names(type(module))


def _megatron_names(cls: type) -> list:
    return [base.__name__ for base in cls.__mro__ if base.__module__.split(".")[0] == "megatron"]


def _role(module: nn.Module) -> Optional[str]:
    return next((MEGATRON_ROLES[name] for name in _megatron_classes(module) if name in MEGATRON_ROLES), None)


def megatron_role(cls: type) -> Optional[str]:
    """What tag_megatron tags in modules of this class: its role by class, "layer" for a TransformerLayer (whose
    attention and MLP it tags), None for a class it leaves alone."""
    names = _megatron_names(cls)
    role = next((MEGATRON_ROLES[name] for name in names if name in MEGATRON_ROLES), None)
    return role or ("layer" if any(name in _LAYERS for name in names) else None)


def _layer_roles(layer: nn.Module) -> Dict[str, nn.Module]:
    """A TransformerLayer's attention and dense MLP (an MoE layer is tagged by its class instead)."""
    found = {}
    for attribute, name in (("self_attention", "attn"), ("mlp", "mlp")):
        child = getattr(layer, attribute, None)
        if isinstance(child, nn.Module) and _role(child) is None \
                and not any(absent in _megatron_classes(child) for absent in _ABSENT):
            found[name] = child
    return found


def tag_megatron(model: nn.Module) -> Dict[str, int]:
    """Tag a Megatron-Core model's attention, dense MLP, MoE layer, MoE router and Mamba mixer; returns how many
    modules got each tag. Raises ConfigError when the model holds none of them."""
    counts: Dict[str, int] = {}

    def put(name: str, module: nn.Module) -> None:
        tag(name)(module)
        counts[name] = counts.get(name, 0) + 1

    for module in list(model.modules()):
        role = _role(module)
        if role is not None:
            put(role, module)
        if any(name in _LAYERS for name in _megatron_classes(module)):
            for name, child in _layer_roles(module).items():
                put(name, child)
    if not counts:
        raise ConfigError(f"tag_megatron found no Megatron-Core TransformerLayer, MoE layer, router or Mamba mixer "
                          f"in {type(model).__name__}; tag other models with cgcompile.tag_modules(...)")
    return counts

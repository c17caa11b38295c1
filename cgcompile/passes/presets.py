"""Modules a tagging preset (tag_hf, tag_megatron) would tag, in a graph where no module carries a tag.

A Hugging Face or Megatron-Core model compiled with `cuda_graph_modules` but never tagged has no tag for the
selection to match: nothing is captured, and before this check nothing said so (a graph holding no tag may be a
fragment after a Dynamo break, so an empty graph alone proves nothing). Modules of the classes a preset covers
do prove it: the planner raises and names the preset to call."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch.fx as fx

from ..hf import hf_role
from ..megatron_tags import megatron_role
from .checkpoints import checkpoint_body
from .common import compute_nodes, module_stack

__all__ = ["PresetModule", "untagged_preset_modules"]

PresetModule = Tuple[str, str, str, str]  # (module path, class name, role, the preset's call)


def untagged_preset_modules(gm: fx.GraphModule) -> List[PresetModule]:
    """The modules of `gm` (activation checkpoints' bodies included) a preset would tag, in order of first use."""
    found: Dict[str, PresetModule] = {}
    for node in compute_nodes(gm):
        body = checkpoint_body(node)
        if body is not None:
            for module in untagged_preset_modules(body):
                found.setdefault(module[0], module)
        for path, cls in module_stack(node):
            if path in found or not isinstance(cls, type):
                continue
            if hf_role(cls):
                found[path] = (path, cls.__name__, hf_role(cls), "cgcompile.tag_hf(model)")
            elif megatron_role(cls):
                found[path] = (path, cls.__name__, megatron_role(cls), "cgcompile.tag_megatron(model)")
    return list(found.values())


def describe_preset_modules(modules: List[PresetModule]) -> str:
    """'It holds modules cgcompile.tag_hf(model) tags: a (LlamaAttention: 'attn'), ...; call it before compiling'."""
    def role(name: str) -> str:
        return "its self_attention and mlp" if name == "layer" else f"'{name}'"

    shown = ", ".join(f"{path} ({cls}: {role(name)})" for path, cls, name, _ in modules[:3])
    more = f" and {len(modules) - 3} more" if len(modules) > 3 else ""
    calls = " / ".join(dict.fromkeys(call for *_, call in modules))
    return f"The graph holds modules {calls} tags: {shown}{more}. Call {calls} before compiling the model"

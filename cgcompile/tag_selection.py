"""Whether `cuda_graph_modules` can match anything: a selected name no module carries is a typo or a missing
tag, and a selection over a model that carries no tag at all captures nothing. Both raise one ConfigError that
names the tags present and the fix (for a Hugging Face or Megatron-Core model: the preset call it needs).

Checked per Dynamo graph at compile time, where a graph may be a fragment after a graph break holding none of
the selected modules: a fragment's missing tags prove nothing about the selection unless the model itself
carries no tag. `explain` checks all of a model's graphs at once."""

from __future__ import annotations

import difflib
from typing import Dict, List, Optional, Sequence

import torch.fx as fx

from .config import CudaGraphConfig
from .errors import ConfigError
from .megatron_flags import unmatched_selection
from .passes import RegionInfo
from .passes.checkpoints import tags_inside
from .passes.presets import PresetModule, describe_preset_modules, untagged_preset_modules

__all__ = ["check_selected_tags", "check_selection", "graph_tags", "selected_tags"]


def selected_tags(config: CudaGraphConfig) -> frozenset:
    """The tag names config.cuda_graph_modules selects (empty: capture every capture-safe span)."""
    return frozenset(str(m.value if hasattr(m, "value") else m) for m in config.cuda_graph_modules)


def graph_tags(regions: Dict[fx.Node, RegionInfo]) -> List[str]:
    """The tags the graph's modules carry, those inside activation checkpoints it keeps whole included."""
    seen: Dict[str, None] = {}
    for node, info in regions.items():
        for _, name in info.tagged:
            seen.setdefault(name)
        seen.update(dict.fromkeys(tags_inside(node)))
    return list(seen)


def check_selected_tags(config: CudaGraphConfig, present: Sequence[str], presets: Sequence[PresetModule] = ()) -> None:
    """Raise when a selected name is carried by no module in `present`. `presets`: the graph's modules tag_hf /
    tag_megatron would tag, named as the fix when no module carries a tag (a model never tagged)."""
    present_set = set(present)
    missing = unmatched_selection(config.cuda_graph_impl, selected_tags(config), present_set)
    if not missing:
        return
    parts = []
    for name in missing:
        close = difflib.get_close_matches(name, sorted(present_set), n=1)
        parts.append(f"'{name}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    fix = (f"{describe_preset_modules(presets)}." if presets and not present_set else
           "Tag the module with @cgcompile.tag(...), cgcompile.tag_modules(...), or fix the name.")
    raise ConfigError(
        f"cuda_graph_modules selects {', '.join(parts)}, but no module in the graph carries that tag; tags present: "
        f"{', '.join(sorted(present_set)) or 'none'}. {fix}")


def check_selection(gm: fx.GraphModule, config: CudaGraphConfig, regions: Dict[fx.Node, RegionInfo], *,
                    whole_frame: bool, model_tagged: Optional[bool]) -> None:
    """One graph's check. `whole_frame`: the graph is a frame of the model's own (not a submodule's method after
    a break); `model_tagged`: whether any module of the model the user called carries a tag (None: unknown, as
    for a compiled function)."""
    present = graph_tags(regions)
    if present:
        if whole_frame and not selected_tags(config) & set(present):
            check_selected_tags(config, present)
        return
    if model_tagged:
        return  # a fragment of a tagged model, holding none of its tagged modules
    presets = untagged_preset_modules(gm)
    # unknown model: a preset's modules in a whole frame show it untagged (any other untagged frame may be glue)
    if model_tagged is False or (whole_frame and presets):
        check_selected_tags(config, present, presets)

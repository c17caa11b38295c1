"""`cgcompile.explain` (what the backend would do with a model, without capturing anything) and the `Plan` it returns.

`Plan` bundles the config, one GraphPlan (plan.py) per Dynamo graph and Dynamo's own graph breaks. It lives here,
above the renderers, so that `print(plan)` and `plan.to_html(path)` call diagnostics.format_plan and
visual.plan_to_html directly while plan.py stays plain data that those renderers import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from . import _compat, counters
from .code_source import data_dependent_break_hint, source_of
from .config import CudaGraphConfig
from .diagnostics import format_plan
from .frame_plan import make_plan
from .frame_root import anchor_module_stacks, frame_root
from .model_state import preserved_model_state
from .passes import module_regions
from .passes.presets import untagged_preset_modules
from .plan import GraphBreak, GraphPlan
from .tag_selection import check_selected_tags, graph_tags
from .visual import plan_to_html

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


@dataclass
class Plan:
    """Everything the backend decided for one compiled function: config, one GraphPlan per Dynamo graph,
    and Dynamo's own graph breaks; after a run with measure_benefit, each partition's measured times (`measured`,
    stats()["benefit"] until reset_stats()). `str(plan)` is the human table; `to_json()` the machine-readable form;
    `to_html(path)` the picture (visual.py)."""

    config: CudaGraphConfig
    graphs: List[GraphPlan] = field(default_factory=list)
    graph_breaks: List[GraphBreak] = field(default_factory=list)
    # after a run with measure_benefit: each partition's measured eager/replay times and saving, by name
    measured: Dict[str, dict] = field(default_factory=dict)

    def __str__(self) -> str:
        return format_plan(self)

    def to_json(self) -> dict:
        return {"config": self.config.to_json_dict(), "graphs": [g.to_json() for g in self.graphs],
                "graph_breaks": [b.to_json() for b in self.graph_breaks], "measured": dict(self.measured)}

    def to_html(self, path=None) -> str:
        return plan_to_html(self, path)


def _user_frames(reason: Any) -> list:
    """The frames of the user's stack at a break, innermost last, torch's own (that Dynamo inlined) left out."""
    stack = getattr(reason, "user_stack", None) or []
    return [frame for frame in stack if not os.path.abspath(frame.filename).startswith(_TORCH_DIR)] or list(stack)


def _break_location(reason: Any) -> Optional[str]:
    stack = getattr(reason, "user_stack", None) or []
    if not stack:
        return None
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno}"


def _break_hint(reason: Any, text: str) -> Optional[str]:
    """The fix for a Dynamo break cgcompile knows how to remove, in the words of the code that breaks
    (transformers, torchtitan, Megatron-Core, the user's own)."""
    data_dependent = ("Dynamic shape operator", "data-dependent", "Data-dependent", "unbacked")
    if not any(word in text for word in data_dependent):
        return None
    frames = _user_frames(reason)
    return data_dependent_break_hint(source_of(frames[-1].filename if frames else None))


def _anchored_graph(gm, example_inputs):
    """Anchor a graph's module stacks at the model while Dynamo still runs its frame, as the backend does: a
    graph resumed after a break inside a module keeps that module's path and tag (frame_root.py)."""
    anchor_module_stacks(gm, frame_root())
    return gm.forward


def _run_dynamo_explain(fn, args, kwargs):
    """What torch._dynamo.explain returns (documented in torch.compiler troubleshooting), with module stacks
    anchored at the model. Like torch's own explain it resets Dynamo's caches before and after, so compiled
    functions recompile on their next call."""
    recorder = _compat.explain_recorder(_anchored_graph)
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=recorder)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    return recorder.output()


def explain(model_or_fn, *args: Any, options: Optional[dict] = None, **kwargs: Any) -> Plan:
    """Trace `model_or_fn(*args, **kwargs)` with Dynamo and return the partition Plan our backend would use,
    including Dynamo's own graph breaks. Bad options raise before any tracing. Nothing is captured.

    Tracing runs the model; its effects are undone (model_state.py): parameters, buffers, grads, the tensors in
    the arguments and every random generator are left as they were found."""
    config = CudaGraphConfig.from_options(options)
    fn = getattr(model_or_fn, "_orig_mod", model_or_fn)
    with preserved_model_state(fn, args, kwargs):
        output = _run_dynamo_explain(fn, args, kwargs)
    plan = Plan(config, measured=counters.snapshot()["benefit"])  # times measured by runs so far, if any
    present: dict = {}
    presets: dict = {}  # the modules tag_hf / tag_megatron would tag, for the error if the model carries no tag
    for index, gm in enumerate(output.graphs):
        inputs = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        # tags are checked over all graphs at once below: one graph of a broken frame may hold none of them
        plan.graphs.append(make_plan(gm, inputs, config, index, validate_tags=False))
        # read after planning: a checkpoint holding a selected module has been inlined, its tags now in sight
        present.update(dict.fromkeys(graph_tags(module_regions(gm))))
        presets.update((module[0], module) for module in untagged_preset_modules(gm))
    if config.cuda_graph_modules and plan.graphs:
        check_selected_tags(config, list(present), list(presets.values()))
    seen = set()
    for reason in output.break_reasons:
        text = str(getattr(reason, "reason", reason))
        brk = GraphBreak(text, _break_location(reason), _break_hint(reason, text))
        if brk not in seen:
            seen.add(brk)
            plan.graph_breaks.append(brk)
    return plan

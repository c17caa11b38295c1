"""Why a region is not captured: the reason categories (`Reason`) and the record a pass, the planner or a
runtime feature writes for one node (`Finding`). Every category the plan, the renderers and the JSON show is a
`Reason` member; docs/troubleshooting.md has one section per member (tests/test_docs.py checks it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .config_values import ChoiceEnum

__all__ = ["Finding", "Reason"]


class Reason(ChoiceEnum):
    """A reason category. Members equal and print as their value, which is what the JSON holds."""

    # found by the passes (passes/): the op itself cannot be captured
    HOST_SYNC = "host_sync"
    DYNAMIC_SHAPE = "dynamic_shape"
    NOT_PADDABLE = "not_paddable"
    COLLECTIVE = "collective"
    CUDAGRAPH_UNSAFE = "cudagraph_unsafe"
    INPUT_MUTATION = "input_mutation"
    SCALAR_INPUT = "scalar_input"
    HOST_TENSOR = "host_tensor"
    # decided by the planner (planner.py): capture-safe, but the config or the region leaves it eager
    EAGER_REGION = "eager_region"
    NOT_SELECTED = "not_selected"
    UNTAGGED = "untagged"
    TOO_SMALL = "too_small"
    DISABLED = "disabled"
    TE_RESTRICTION = "te_restriction"
    # a runtime feature's plan-time reason (runtime/frame/fsdp.py)
    FSDP_RESHARDED_PARAMS = "fsdp_resharded_params"
    # measured at run time (runtime/local/benefit.py, runtime/local/budget.py): captured, then sent back to eager
    NOT_PROFITABLE = "not_profitable"
    MEMORY_BUDGET = "memory_budget"


@dataclass(frozen=True)
class Finding:
    """Why one node cannot be captured: category, op, the user's file:line, module path, and a fix hint.
    `downstream`: the op only consumes a data-dependent size another finding's op made (fixing that op fixes
    this one; such findings carry no hint of their own)."""

    category: Reason
    op: str
    location: Optional[str]
    module: Optional[str]
    hint: Optional[str] = None
    detail: Optional[str] = None
    downstream: bool = False

    def to_json(self) -> dict:
        return {"category": self.category.value, "op": self.op, "location": self.location, "module": self.module,
                "hint": self.hint, "detail": self.detail}

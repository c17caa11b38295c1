"""The option sets of the Megatron-Core parity test, and how one run of them is summarized for comparison.

Shared by tests/megatron_oracle.py (runs them through Megatron-Core, under a Python 3.12 venv) and
tests/test_megatron_parity.py (runs them through cgcompile). Pure: no torch, no Megatron, no cgcompile import.

An option value that is an enum member is written as ``{"enum": "<class>", "member": "<name>"}`` so the cases
and the recorded results stay plain JSON; :func:`decode` turns it back into a member of the caller's enum class
(Megatron's own, or a stand-in with the same names and values when Megatron is not installed).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

UNSET = object()  # the option is left out

# Megatron-Core 0.19.2's enums (megatron/core/transformer/enums.py): names and values.
MEGATRON_ENUMS: dict[str, dict[str, int]] = {
    "CudaGraphModule": {"attn": 1, "mlp": 2, "moe": 3, "moe_router": 4, "moe_preprocess": 5, "mamba": 6},
    "CudaGraphScope": {"full_iteration": 1, "attn": 2, "mlp": 3, "moe": 4, "moe_router": 5,
                       "moe_preprocess": 6, "mamba": 7},
    "InferenceCudaGraphScope": {"none": 1, "layer": 2, "block": 3},
}


def member(enum_name: str, name: str) -> dict[str, str]:
    return {"enum": enum_name, "member": name}


def decode(value: Any, enum_classes: Mapping[str, type[enum.Enum]]) -> Any:
    """JSON option value -> Python value, enum references resolved against ``enum_classes``."""
    if isinstance(value, dict) and set(value) == {"enum", "member"}:
        return enum_classes[value["enum"]][value["member"]]
    if isinstance(value, list):
        return [decode(item, enum_classes) for item in value]
    return value


def stand_in_enums() -> dict[str, type[enum.Enum]]:
    """Enums with Megatron's names and values, for replaying the recorded cases without Megatron installed."""
    return {name: enum.Enum(name, members) for name, members in MEGATRON_ENUMS.items()}


def _case(case_id: str, **options: Any) -> dict[str, Any]:
    return {"id": case_id, "options": {name: value for name, value in options.items() if value is not UNSET}}


_IMPLS = ["none", "local", "transformer_engine", "full_iteration"]
_MODULE_VALUES: list[tuple[str, Any]] = [
    ("empty", []),
    ("attn", ["attn"]),
    ("attn_mlp", ["attn", "mlp"]),
    ("moe", ["moe"]),
    ("moe_router", ["moe_router"]),
    ("moe_preprocess", ["moe_preprocess"]),
    ("moe+moe_router", ["moe", "moe_router"]),
    ("moe_router+moe_preprocess", ["moe_router", "moe_preprocess"]),
    ("attn+moe_router", ["attn", "moe_router"]),
    ("mamba", ["mamba"]),
    ("full_str", "full"),
    ("full_list", ["full"]),
    ("full_iteration", ["full_iteration"]),
    ("full_iteration_inference", ["full_iteration_inference"]),
    ("comma_str", "attn,mlp"),
]
_SCOPE_VALUES: list[tuple[str, Any]] = [
    ("empty", []),
    ("attn", ["attn"]),
    ("attn+moe_router", ["attn", "moe_router"]),
    ("moe_preprocess", ["moe_preprocess"]),
    ("full_str", "full"),
    ("full_iteration", ["full_iteration"]),
    ("full_iteration_inference", ["full_iteration_inference"]),
    ("attn+full_iteration_inference", ["attn", "full_iteration_inference"]),
]


def cases() -> list[dict[str, Any]]:
    """Every option set of the parity grid, each with a stable id."""
    out: list[dict[str, Any]] = []
    # the new spelling: every impl with every module list
    for impl in _IMPLS:
        for name, modules in _MODULE_VALUES:
            out.append(_case(f"impl={impl}/modules={name}", cuda_graph_impl=impl, cuda_graph_modules=modules))
    # impl left out: cgcompile's default is local, Megatron's none
    for name in ("empty", "attn", "moe_router"):
        out.append(_case(f"impl=unset/modules={name}", cuda_graph_modules=dict(_MODULE_VALUES)[name]))
    out.append(_case("all_unset"))
    # the deprecated cuda_graph_scope
    for impl in ("unset", "none", "local"):
        for name, scope in _SCOPE_VALUES:
            out.append(_case(f"impl={impl}/scope={name}", cuda_graph_impl=UNSET if impl == "unset" else impl,
                             cuda_graph_scope=scope))
    out += [
        _case("scope=attn+modules=empty", cuda_graph_impl="local", cuda_graph_scope=["attn"], cuda_graph_modules=[]),
        _case("scope=attn+modules=full_str", cuda_graph_impl="local", cuda_graph_scope=["attn"],
              cuda_graph_modules="full"),
        _case("scope=attn+modules=mlp", cuda_graph_impl="local", cuda_graph_scope=["attn"],
              cuda_graph_modules=["mlp"]),
        _case("scope=empty+modules=attn", cuda_graph_impl="local", cuda_graph_scope=[],
              cuda_graph_modules=["attn"]),
        _case("scope=full_iteration+full_iteration_inference", cuda_graph_impl="local",
              cuda_graph_scope=["full_iteration", "full_iteration_inference"]),
        _case("scope=full+attn", cuda_graph_impl="local", cuda_graph_scope=["full", "attn"]),
        _case("impl=transformer_engine/scope=full_iteration", cuda_graph_impl="transformer_engine",
              cuda_graph_scope=["full_iteration"]),
        _case("impl=transformer_engine/scope=full_iteration_inference", cuda_graph_impl="transformer_engine",
              cuda_graph_scope=["full_iteration_inference"]),
        _case("impl=local/modules=attn+full_iteration", cuda_graph_impl="local",
              cuda_graph_modules=["attn", "full_iteration"]),
    ]
    # the deprecated impl flags
    out += [
        _case("enable", enable_cuda_graph=True),
        _case("enable=False", enable_cuda_graph=False, cuda_graph_impl="local"),
        _case("external", external_cuda_graph=True),
        _case("enable+external", enable_cuda_graph=True, external_cuda_graph=True),
        _case("enable+impl=none", enable_cuda_graph=True, cuda_graph_impl="none"),
        _case("external+impl=none", external_cuda_graph=True, cuda_graph_impl="none"),
        _case("enable+impl=local", enable_cuda_graph=True, cuda_graph_impl="local"),
        _case("external+impl=transformer_engine", external_cuda_graph=True, cuda_graph_impl="transformer_engine"),
        _case("enable+scope=attn_mlp_str", enable_cuda_graph=True, cuda_graph_scope="attn,mlp"),
        _case("enable+scope=full_iteration_inference", enable_cuda_graph=True,
              cuda_graph_scope=["full_iteration_inference"]),
        _case("enable+impl=none+scope=full_iteration_inference", enable_cuda_graph=True, cuda_graph_impl="none",
              cuda_graph_scope=["full_iteration_inference"]),
        _case("external+scope=full_iteration", external_cuda_graph=True, cuda_graph_scope=["full_iteration"]),
        _case("external+modules=moe_preprocess", external_cuda_graph=True, cuda_graph_modules=["moe_preprocess"]),
    ]
    # the inference scope
    for impl in _IMPLS:
        for scope in ("none", "layer", "block"):
            out.append(_case(f"impl={impl}/inference={scope}", cuda_graph_impl=impl,
                             inference_cuda_graph_scope=scope))
    out += [
        _case("scope=full_iteration_inference+inference=block", cuda_graph_impl="local",
              cuda_graph_scope=["full_iteration_inference"], inference_cuda_graph_scope="block"),
        _case("scope=full_iteration_inference+inference=layer", cuda_graph_impl="local",
              cuda_graph_scope=["full_iteration_inference"], inference_cuda_graph_scope="layer"),
        _case("scope=full_iteration+inference=layer", cuda_graph_impl="local",
              cuda_graph_scope=["full_iteration"], inference_cuda_graph_scope="layer"),
        _case("impl=none/scope=full_iteration_inference+inference=block", cuda_graph_impl="none",
              cuda_graph_scope=["full_iteration_inference"], inference_cuda_graph_scope="block"),
    ]
    # Megatron's enum members as values
    module, scope_member, inference = "CudaGraphModule", "CudaGraphScope", "InferenceCudaGraphScope"
    out += [
        _case("enum/modules=attn+moe_router", cuda_graph_impl="local",
              cuda_graph_modules=[member(module, "attn"), member(module, "moe_router")]),
        _case("enum/modules=moe_preprocess", cuda_graph_impl="local",
              cuda_graph_modules=[member(module, "moe_preprocess")]),
        _case("enum/modules=single_member", cuda_graph_impl="local", cuda_graph_modules=member(module, "mlp")),
        _case("enum/scope=attn+moe_router", cuda_graph_impl="local",
              cuda_graph_scope=[member(scope_member, "attn"), member(scope_member, "moe_router")]),
        _case("enum/scope=full_iteration", cuda_graph_impl="local",
              cuda_graph_scope=[member(scope_member, "full_iteration")]),
        _case("enum/inference=block", cuda_graph_impl="local",
              inference_cuda_graph_scope=member(inference, "block")),
    ]
    # warmup
    for name, steps in (("1", 1), ("0", 0), ("-1", -1), ("1.5", 1.5)):
        out.append(_case(f"warmup={name}", cuda_graph_impl="local", cuda_graph_warmup_steps=steps))
    # where cgcompile is deliberately friendlier
    out += [
        _case("modules=full+full", cuda_graph_impl="local", cuda_graph_modules=["full", "full"]),
        _case("modules=attn+attn", cuda_graph_impl="local", cuda_graph_modules=["attn", "attn"]),
        _case("modules=comma_str_spaces", cuda_graph_impl="local", cuda_graph_modules="attn, mlp"),
        _case("modules=comma_str_empty_piece", cuda_graph_impl="local", cuda_graph_modules="attn,,mlp"),
        _case("modules=empty_str", cuda_graph_impl="local", cuda_graph_modules=""),
        _case("modules=custom_tag", cuda_graph_impl="local", cuda_graph_modules=["attn", "my_block"]),
        _case("modules=upper_case", cuda_graph_impl="local", cuda_graph_modules=["ATTN"]),
        _case("impl=upper_case", cuda_graph_impl="Local"),
        _case("impl=bogus", cuda_graph_impl="loacl"),
        _case("impl=None", cuda_graph_impl=None),
        _case("modules=None", cuda_graph_impl="local", cuda_graph_modules=None),
        _case("enable=str", enable_cuda_graph="yes"),
        _case("enable=1", enable_cuda_graph=1),
    ]
    ids = [case["id"] for case in out]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return out


def _spells_full(options: Mapping[str, Any]) -> bool:
    values = [options.get("cuda_graph_modules"), options.get("cuda_graph_scope")]
    return any(v == "full" or (isinstance(v, list) and "full" in v) for v in values)


def summarize(accepted: bool, impl: str = "", modules: list[str] | None = None, inference: str = "",
              warned: bool = False) -> dict[str, Any]:
    """What is compared between Megatron and cgcompile: accept/reject and, when accepted, the normalized impl,
    the module set, the inference scope, and whether a warning was emitted."""
    if not accepted:
        return {"accepted": False}
    return {"accepted": True, "impl": impl, "modules": sorted(set(modules or [])), "inference": inference,
            "warned": warned}


def summary_of_record(case: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """The comparable part of one recorded Megatron result.

    Megatron-Core 0.19.2's own default is the deprecated ``cuda_graph_modules="full"``, so it warns "full scope
    is deprecated" when the user set nothing; that warning counts only when the case spells "full" itself.
    """
    if not result["accepted"]:
        return summarize(False)
    warned = [w for w in result["warnings"]
              if "full scope is deprecated" not in w or _spells_full(case["options"])]
    return summarize(True, result["cuda_graph_impl"], result["cuda_graph_modules"],
                     result["inference_cuda_graph_scope"], bool(warned))

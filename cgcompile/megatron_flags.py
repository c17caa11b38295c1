"""Megatron-LM's CUDA-graph vocabulary and its rules, as Megatron-Core 0.19.2's TransformerConfig applies them.

The three options Megatron and cgcompile share (``cuda_graph_impl``, ``cuda_graph_modules``,
``inference_cuda_graph_scope``) are normalized here, with Megatron's deprecated spellings (``enable_cuda_graph``,
``external_cuda_graph``, ``cuda_graph_scope``, and the old scope values ``full``, ``full_iteration``,
``full_iteration_inference``) migrated to the new ones, each recorded as a :class:`Migration`. The same
option sets give the same accept/reject and normalized values as Megatron-Core 0.19.2, except for the
deliberate differences listed in docs/guides/megatron.md (tests/test_megatron_parity.py checks both).
Megatron's rules that depend on the model (``moe`` on a model without MoE layers) are checked against the
traced graph at plan time, not here. Pure: no torch import.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
from collections.abc import Mapping, Sequence, Set
from typing import Any

from .config_values import ChoiceEnum, enum_text, parse_bool, parse_enum, show_list
from .errors import ConfigError


class CudaGraphImpl(ChoiceEnum):
    """Which capture machinery runs the selected regions."""

    NONE = "none"
    LOCAL = "local"
    TRANSFORMER_ENGINE = "transformer_engine"
    FULL_ITERATION = "full_iteration"


class CudaGraphModule(ChoiceEnum):
    """Megatron's module names for ``cuda_graph_modules``.

    The last three are deprecated scope values (see :attr:`deprecated`): :meth:`CudaGraphConfig.from_options
    <cgcompile.config.CudaGraphConfig.from_options>` migrates them to other options, as Megatron-Core does;
    a directly constructed config rejects them with the fix.
    """

    ATTN = "attn"
    MLP = "mlp"
    MOE = "moe"
    MOE_ROUTER = "moe_router"
    MOE_PREPROCESS = "moe_preprocess"
    MAMBA = "mamba"
    FULL_ITERATION = "full_iteration"
    FULL_ITERATION_INFERENCE = "full_iteration_inference"
    FULL = "full"

    @property
    def deprecated(self) -> bool:
        """True for the deprecated scope values, which name other options rather than a module."""
        return self in _DEPRECATED_VALUE_FIXES


# Deprecated alias: Megatron's former name for the module enum (its option was ``cuda_graph_scope``).
CudaGraphScope = CudaGraphModule


class InferenceCudaGraphScope(ChoiceEnum):
    """What one inference graph covers: nothing, one layer, or a block of layers."""

    NONE = "none"
    LAYER = "layer"
    BLOCK = "block"


@dataclasses.dataclass(frozen=True)
class Migration:
    """One rewrite of the given options, kept on the config so the plan, logs and JSON can show it.

    ``deprecated``: a deprecated spelling migrated to the new one (warns with a FutureWarning, as Megatron
    warns); False for a normalization Megatron-Core also makes silently (the local impl's moe_router /
    moe_preprocess pairing).
    """

    old: str
    new: str
    deprecated: bool = True

    def __str__(self) -> str:
        return f"{self.old} -> {self.new}"


_M = CudaGraphModule
_IMPL = CudaGraphImpl

DEPRECATED_OPTIONS = ("enable_cuda_graph", "external_cuda_graph", "cuda_graph_scope")

# Deprecated scope values and what to write instead.
_DEPRECATED_VALUE_FIXES: dict[CudaGraphModule, str] = {
    _M.FULL_ITERATION: "use cuda_graph_impl='full_iteration' (whole-step capture) instead",
    _M.FULL_ITERATION_INFERENCE: "use inference_cuda_graph_scope='block' instead",
    _M.FULL: "leave cuda_graph_modules empty (empty = whole layer) instead",
}
_MEGATRON_MODULES: tuple[CudaGraphModule, ...] = tuple(m for m in CudaGraphModule if not m.deprecated)

# Inference scopes each impl allows; the first is the default.
_ALLOWED_INFERENCE_SCOPES: dict[CudaGraphImpl, tuple[InferenceCudaGraphScope, ...]] = {
    _IMPL.NONE: (InferenceCudaGraphScope.NONE,),
    _IMPL.LOCAL: (InferenceCudaGraphScope.LAYER, InferenceCudaGraphScope.BLOCK),
    _IMPL.TRANSFORMER_ENGINE: (InferenceCudaGraphScope.NONE,),
    _IMPL.FULL_ITERATION: (InferenceCudaGraphScope.NONE,),
}

# The local impl captures the MoE router and its preprocessing as one region: either name selects both.
_LOCAL_ROUTER_PAIR = (_M.MOE_ROUTER, _M.MOE_PREPROCESS)

# A custom tag this similar to a Megatron name is taken for a typo of it ...
_NEAR_MISS_CUTOFF = 0.8


def _is_deliberate_variant(name: str, megatron_name: str) -> bool:
    """... unless it extends that name with a numbered or ``_``-joined part (``attn2``, ``x_attn``, ``mlp_1``)."""
    return re.fullmatch(rf"(?:\w+_)?{re.escape(megatron_name)}(?:_\w+|\d+)?", name) is not None


# ---------------------------------------------------------------------------------------------------
# from_options: the shared options, old spellings migrated


def normalize_megatron_options(given: Mapping[str, Any]) -> tuple[dict[str, Any], list[Migration]]:
    """Options (None values already dropped) -> normalized ``cuda_graph_impl``, ``cuda_graph_modules`` and
    ``inference_cuda_graph_scope``, plus the rewrites made, in Megatron-Core's order: impl flags, then the
    module option with its deprecated values, then the cross-option rules."""
    migrations: list[Migration] = []
    # How each normalized field was spelled by the user, for error messages about migrated values.
    spelled: dict[str, str] = {}
    impl = _impl_from_flags(given, spelled, migrations)
    inference = given.get("inference_cuda_graph_scope")
    if inference is not None:
        inference = parse_enum("inference_cuda_graph_scope", inference, InferenceCudaGraphScope)
    impl, modules, inference = _module_option(given, impl, inference, spelled, migrations)
    modules, inference, rewrites = check_combination(impl, modules, inference, spelled)
    fields = {"cuda_graph_impl": impl, "cuda_graph_modules": modules, "inference_cuda_graph_scope": inference}
    return fields, migrations + rewrites


def _impl_from_flags(given: Mapping[str, Any], spelled: dict[str, str], migrations: list[Migration]) -> CudaGraphImpl:
    """enable_cuda_graph=True -> local, external_cuda_graph=True -> transformer_engine; False is a no-op.

    An explicit ``cuda_graph_impl='none'`` is Megatron's default, so, as there, it counts as not set.
    """
    enable = parse_bool("enable_cuda_graph", given.get("enable_cuda_graph", False))
    external = parse_bool("external_cuda_graph", given.get("external_cuda_graph", False))
    explicit = parse_enum("cuda_graph_impl", given["cuda_graph_impl"], CudaGraphImpl) \
        if "cuda_graph_impl" in given else None
    if enable and external:
        raise ConfigError(
            "enable_cuda_graph=True and external_cuda_graph=True are two deprecated spellings of "
            "cuda_graph_impl that disagree ('local' vs 'transformer_engine'); set only "
            "cuda_graph_impl='local' or cuda_graph_impl='transformer_engine'"
        )
    if not (enable or external):
        if explicit is None:
            spelled["cuda_graph_impl"] = "cuda_graph_impl='local' (the default)"
            return _IMPL.LOCAL
        return explicit
    flag, impl = ("enable_cuda_graph", _IMPL.LOCAL) if enable else ("external_cuda_graph", _IMPL.TRANSFORMER_ENGINE)
    if explicit not in (None, _IMPL.NONE):
        raise ConfigError(
            f"{flag}=True and cuda_graph_impl={given['cuda_graph_impl']!r} are the old and new spelling of "
            f"the same option; drop {flag} and keep cuda_graph_impl ({flag}=True means "
            f"cuda_graph_impl={impl.value!r})"
        )
    old = f"{flag}=True" + (", cuda_graph_impl='none' (Megatron's default)" if explicit is not None else "")
    migrations.append(Migration(old, f"cuda_graph_impl={impl.value!r}"))
    spelled["cuda_graph_impl"] = f"cuda_graph_impl={impl.value!r} (from {flag}=True)"
    return impl


def _is_megatron_default_modules(value: Any) -> bool:
    """The values Megatron takes for "cuda_graph_modules not set" beside cuda_graph_scope: its default "full",
    and the empty list a full argument dump carries."""
    if isinstance(value, str):
        return value.strip().lower() == "full"
    return isinstance(value, (list, tuple)) and len(value) == 0


def _module_option(
    given: Mapping[str, Any],
    impl: CudaGraphImpl,
    inference: InferenceCudaGraphScope | None,
    spelled: dict[str, str],
    migrations: list[Migration],
) -> tuple[CudaGraphImpl, tuple[CudaGraphModule | str, ...], InferenceCudaGraphScope | None]:
    """``cuda_graph_modules`` (or the deprecated ``cuda_graph_scope``) with its deprecated values migrated:
    ``full`` -> [] (whole layer), ``full_iteration`` -> cuda_graph_impl='full_iteration',
    ``full_iteration_inference`` -> inference_cuda_graph_scope='block'."""
    option = "cuda_graph_scope" if "cuda_graph_scope" in given else "cuda_graph_modules"
    values = parse_modules(option, given.get(option, ()), allow_deprecated=True)
    deprecated = [m for m in values if isinstance(m, CudaGraphModule) and m.deprecated]
    modules = tuple(m for m in values if m not in deprecated)
    old = f"{option}={show_list(values)}"
    fixes = "; ".join(f"{m.value!r}: {_DEPRECATED_VALUE_FIXES[m]}" for m in deprecated)
    if option == "cuda_graph_scope":
        if "cuda_graph_modules" in given and not _is_megatron_default_modules(given["cuda_graph_modules"]):
            raise ConfigError(
                f"{old} and cuda_graph_modules={given['cuda_graph_modules']!r} are the old and new spelling of "
                f"the same option; keep only cuda_graph_modules" + (f" ({fixes})" if fixes else "")
            )
        spelled["cuda_graph_modules"] = old
    elif not deprecated:
        return impl, modules, inference
    if len(deprecated) > 1:
        raise ConfigError(
            f"{old} combines deprecated values {show_list(deprecated)} that mean different things; keep one ({fixes})"
        )
    impl_spelled = spelled.get("cuda_graph_impl", f"cuda_graph_impl={impl.value!r}")
    value = deprecated[0] if deprecated else None
    if value is None:
        new = f"cuda_graph_modules={show_list(modules)}"
    elif value is _M.FULL:
        if modules:
            raise ConfigError(
                f"{old}: 'full' (the whole layer) cannot be combined with other modules; use "
                f"cuda_graph_modules=[] for the whole layer, or cuda_graph_modules={show_list(modules)} "
                f"for just those"
            )
        new = "cuda_graph_modules=[] (whole layer)"
    elif value is _M.FULL_ITERATION:
        if impl not in (_IMPL.NONE, _IMPL.LOCAL, _IMPL.FULL_ITERATION):
            raise ConfigError(
                f"{old} conflicts with {impl_spelled}: 'full_iteration' means cuda_graph_impl='full_iteration' "
                f"(whole-step capture), a different impl; set only cuda_graph_impl='full_iteration'"
            )
        if modules:
            raise ConfigError(
                f"{old}: cuda_graph_modules must be empty for full_iteration, which captures the whole step; "
                f"drop {show_list(modules)}, or use cuda_graph_impl='local' with "
                f"cuda_graph_modules={show_list(modules)} to capture only those"
            )
        impl = _IMPL.FULL_ITERATION
        spelled["cuda_graph_impl"] = f"cuda_graph_impl='full_iteration' (from {old})"
        new = "cuda_graph_impl='full_iteration'"
    else:  # full_iteration_inference
        if impl not in (_IMPL.LOCAL, _IMPL.NONE):
            raise ConfigError(
                f"{old} conflicts with {impl_spelled}: 'full_iteration_inference' means local capture with "
                f"inference_cuda_graph_scope='block', which needs cuda_graph_impl='local'"
            )
        if inference not in (None, InferenceCudaGraphScope.BLOCK):
            raise ConfigError(
                f"{old} conflicts with inference_cuda_graph_scope={inference.value!r}: "
                f"'full_iteration_inference' means inference_cuda_graph_scope='block'; drop one of them"
            )
        if impl is _IMPL.NONE:  # Megatron: "has no effect when cuda_graph_impl='none'"
            new = f"cuda_graph_modules={show_list(modules)} (full_iteration_inference has no effect with " \
                  f"cuda_graph_impl='none'; use cuda_graph_impl='local' with inference_cuda_graph_scope='block')"
        else:
            inference = InferenceCudaGraphScope.BLOCK
            spelled["inference_cuda_graph_scope"] = f"inference_cuda_graph_scope='block' (from {old})"
            new = "inference_cuda_graph_scope='block'"
            if modules:
                new = f"cuda_graph_modules={show_list(modules)}, {new}"
    migrations.append(Migration(old, new))
    return impl, modules, inference


# ---------------------------------------------------------------------------------------------------
# rules shared by from_options and direct construction


def check_combination(
    impl: CudaGraphImpl,
    modules: tuple[CudaGraphModule | str, ...],
    inference: InferenceCudaGraphScope | None,
    spelled: Mapping[str, str],
) -> tuple[tuple[CudaGraphModule | str, ...], InferenceCudaGraphScope, list[Migration]]:
    """Cross-option rules. Returns the modules (the local impl's router pair completed, recorded as a
    Migration), the inference scope with the impl's default filled in, and the rewrites made.

    With impl ``none`` nothing is captured, so, as in Megatron-Core, the module rules are not applied; the
    modules are kept as given, so the plan header still shows the selection.
    """
    impl_text = spelled.get("cuda_graph_impl", f"cuda_graph_impl={impl.value!r}")
    modules_text = spelled.get("cuda_graph_modules", f"cuda_graph_modules={show_list(modules)}")
    rewrites: list[Migration] = []
    if impl is _IMPL.FULL_ITERATION and modules:
        raise ConfigError(
            f"{modules_text} must be empty with {impl_text}, which captures the whole step; drop the modules, "
            f"or use cuda_graph_impl='local' to capture only those regions"
        )
    if impl is not _IMPL.NONE:
        router = [m for m in (_LOCAL_ROUTER_PAIR if impl is _IMPL.LOCAL else (_M.MOE_ROUTER,)) if m in modules]
        if _M.MOE in modules and router:
            paired = "" if router[0] is _M.MOE_ROUTER else " (the local impl captures 'moe_preprocess' " \
                                                          "together with 'moe_router')"
            raise ConfigError(
                f"{modules_text} selects both 'moe' and {router[0].value!r}{paired}; choose 'moe' (the whole "
                f"MoE layer) or 'moe_router' (the router, optionally with 'moe_preprocess'), not both"
            )
        if impl is _IMPL.LOCAL and router:
            paired = modules + tuple(m for m in _LOCAL_ROUTER_PAIR if m not in modules)
            if paired != modules:
                rewrites.append(Migration(
                    f"cuda_graph_modules={show_list(modules)}",
                    f"cuda_graph_modules={show_list(paired)} (the local impl captures 'moe_router' and "
                    f"'moe_preprocess' together, as Megatron-Core's does)",
                    deprecated=False))
                modules = paired
        if _M.MOE_PREPROCESS in modules and _M.MOE_ROUTER not in modules:
            raise ConfigError(f"{modules_text}: 'moe_preprocess' requires 'moe_router' with {impl_text}; "
                              f"add 'moe_router'")
    allowed = _ALLOWED_INFERENCE_SCOPES[impl]
    if inference is None:
        return modules, allowed[0], rewrites
    if inference not in allowed:
        inference_text = spelled.get("inference_cuda_graph_scope", f"inference_cuda_graph_scope={inference.value!r}")
        raise ConfigError(
            f"{inference_text} is not allowed with {impl_text}; allowed: "
            f"{', '.join(repr(scope.value) for scope in allowed)}"
        )
    return modules, inference, rewrites


def unmatched_selection(impl: CudaGraphImpl, selected: Set[str], present: Set[str]) -> list[str]:
    """The selected module names no module in the graph carries, sorted. With the local impl, moe_router and
    moe_preprocess are one selection (either name selects both), so the pair is matched by either tag."""
    missing = set(selected) - set(present)
    pair = {m.value for m in _LOCAL_ROUTER_PAIR}
    if impl is _IMPL.LOCAL and pair & set(present):
        missing -= pair
    return sorted(missing)


# ---------------------------------------------------------------------------------------------------
# module names


def parse_modules(option: str, value: Any, *, allow_deprecated: bool) -> tuple[CudaGraphModule | str, ...]:
    """A list, tuple, comma-separated string or single enum member -> deduplicated tuple, order kept."""
    if isinstance(value, str):
        items: Sequence[Any] = [piece for piece in value.split(",") if piece.strip()]
    elif isinstance(value, enum.Enum):
        items = [value]
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        items = value
    else:
        unordered = " (sets have no order; use a list)" if isinstance(value, Set) else ""
        raise ConfigError(
            f"{option} must be a list, tuple or comma-separated string of module names, "
            f"got {value!r} ({type(value).__name__}){unordered}"
        )
    modules = (_parse_module_name(option, item, allow_deprecated) for item in items)
    return tuple(dict.fromkeys(modules))


def _parse_module_name(option: str, item: Any, allow_deprecated: bool) -> CudaGraphModule | str:
    if isinstance(item, CudaGraphModule):
        member: CudaGraphModule | None = item
        text = item.value
    else:
        if isinstance(item, enum.Enum):
            text = enum_text(item)
        elif isinstance(item, str):
            text = item
        else:
            raise ConfigError(f"{option}: module names must be strings, got {item!r} ({type(item).__name__})")
        text = text.strip()
        try:
            member = CudaGraphModule(text)
        except ValueError:
            member = None
    if member is None:
        return _custom_tag(option, text)
    if member.deprecated and not allow_deprecated:
        raise ConfigError(
            f"{option}: {member.value!r} is not a module but a deprecated value (only "
            f"CudaGraphConfig.from_options migrates it); {_DEPRECATED_VALUE_FIXES[member]}"
        )
    return member


def _custom_tag(option: str, text: str) -> str:
    """A user tag: any Python identifier that is not a near-miss of a Megatron name."""
    megatron = ", ".join(repr(m.value) for m in _MEGATRON_MODULES)
    folded = text.lower()
    close = difflib.get_close_matches(folded, CudaGraphModule.choices(), n=1, cutoff=_NEAR_MISS_CUTOFF)
    if close and not _is_deliberate_variant(folded, close[0]):
        raise ConfigError(
            f"{option}: unknown module {text!r}; did you mean {close[0]!r}? Megatron modules: {megatron}; "
            f"custom tags are allowed, but not ones this close to a Megatron name"
        )
    if not text.isidentifier():
        raise ConfigError(
            f"{option}: {text!r} is neither a Megatron module ({megatron}) nor a valid Python identifier, "
            f"which a custom tag must be"
        )
    return text

"""Backend options -> one normalized, frozen :class:`CudaGraphConfig` (design.md section 2).

Megatron-LM's CUDA-graph vocabulary is the public surface. Its deprecated spellings
(``enable_cuda_graph``, ``external_cuda_graph``, ``cuda_graph_scope``) are rewritten here, each with one
FutureWarning and a :class:`Migration` record on the config, so the rest of cgcompile only ever sees the
new spelling. Every invalid or contradictory input raises one :class:`~cgcompile.errors.ConfigError` whose
message names the option, the value and the fix.

Pure on purpose: no torch import, no tracing, no global state, so it can be tested and reused alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import operator
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence, Set
from typing import Any

from .errors import ConfigError

__all__ = [
    "ConfigError",
    "CudaGraphConfig",
    "CudaGraphImpl",
    "CudaGraphModule",
    "CudaGraphScope",
    "DriverKind",
    "InferenceCudaGraphScope",
    "DynamicPadding",
    "InnerCompiler",
    "Migration",
]


class _StrEnum(str, enum.Enum):
    """A str enum: members equal and print as their value; lookup also takes names, case-insensitively."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def _missing_(cls, value: object) -> _StrEnum | None:
        if isinstance(value, str):
            folded = value.strip().lower()
            for member in cls:
                if folded in (member.value, member.name.lower()):
                    return member
        return None

    @classmethod
    def choices(cls) -> list[str]:
        """The accepted values, in declaration order (for messages and docs)."""
        return [member.value for member in cls]


class CudaGraphImpl(_StrEnum):
    """Which capture machinery runs the selected regions."""

    NONE = "none"
    LOCAL = "local"
    TRANSFORMER_ENGINE = "transformer_engine"
    FULL_ITERATION = "full_iteration"


class CudaGraphModule(_StrEnum):
    """Megatron's module names for ``cuda_graph_modules``.

    The last three are only meaningful as deprecated ``cuda_graph_scope`` values, which are migrated to
    other options (see :attr:`deprecated`); ``cuda_graph_modules`` rejects them with the fix.
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
        """True for values that only the deprecated ``cuda_graph_scope`` accepts."""
        return self in _DEPRECATED_SCOPE_FIXES


# Deprecated alias: Megatron's former name for the module enum (its option was ``cuda_graph_scope``).
CudaGraphScope = CudaGraphModule


class InferenceCudaGraphScope(_StrEnum):
    """What one inference graph covers: nothing, one layer, or a block of layers."""

    NONE = "none"
    LAYER = "layer"
    BLOCK = "block"


class DriverKind(_StrEnum):
    """How captured partitions execute: real CUDA graphs, a CPU emulation of capture/replay, or eager."""

    AUTO = "auto"
    CUDA = "cuda"
    EMULATE = "emulate"
    EAGER = "eager"


class DynamicPadding(_StrEnum):
    """How data-dependent row counts (nonzero, torch.where(mask), boolean masks) are made capturable."""

    OFF = "off"
    MAX = "max"
    BUCKETS = "buckets"


class InnerCompiler(_StrEnum):
    """What runs inside a captured partition: its own kernels, or Inductor-fused ones."""

    EAGER = "eager"
    INDUCTOR = "inductor"


_M = CudaGraphModule

# Deprecated-only scope values and what to write instead.
_DEPRECATED_SCOPE_FIXES: dict[CudaGraphModule, str] = {
    _M.FULL_ITERATION: "use cuda_graph_impl='full_iteration' (whole-step capture) instead",
    _M.FULL_ITERATION_INFERENCE: "use inference_cuda_graph_scope='block' instead",
    _M.FULL: "leave cuda_graph_modules empty (empty = whole layer) instead",
}
_MEGATRON_MODULES: tuple[CudaGraphModule, ...] = tuple(m for m in CudaGraphModule if not m.deprecated)

# Inference scopes each impl allows; the first is the default.
_ALLOWED_INFERENCE_SCOPES: dict[CudaGraphImpl, tuple[InferenceCudaGraphScope, ...]] = {
    CudaGraphImpl.NONE: (InferenceCudaGraphScope.NONE,),
    CudaGraphImpl.LOCAL: (InferenceCudaGraphScope.LAYER, InferenceCudaGraphScope.BLOCK),
    CudaGraphImpl.TRANSFORMER_ENGINE: (InferenceCudaGraphScope.NONE,),
    CudaGraphImpl.FULL_ITERATION: (InferenceCudaGraphScope.NONE,),
}

_DEPRECATED_OPTIONS = ("enable_cuda_graph", "external_cuda_graph", "cuda_graph_scope")

# A custom tag this similar to a Megatron name is taken for a typo of it ...
_NEAR_MISS_CUTOFF = 0.8


def _is_deliberate_variant(name: str, megatron_name: str) -> bool:
    """... unless it extends that name with a numbered or ``_``-joined part (``attn2``, ``x_attn``, ``mlp_1``)."""
    return re.fullmatch(rf"(?:\w+_)?{re.escape(megatron_name)}(?:_\w+|\d+)?", name) is not None


@dataclasses.dataclass(frozen=True)
class Migration:
    """One deprecated spelling rewritten to the new one; kept on the config so logs and JSON can show it."""

    old: str
    new: str

    def __str__(self) -> str:
        return f"{self.old} -> {self.new}"


class _ReadOnlyMapping(Mapping):
    """A read-only dict copy: compares like a dict, pickles and deep-copies (a mappingproxy does not)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CudaGraphConfig:
    """The backend's options, normalized and validated; build it with :meth:`from_options`.

    Direct construction normalizes and validates too (strings, names and lists become enums and tuples),
    but only :meth:`from_options` understands the deprecated option names.

    Attributes:
        cuda_graph_impl: none | local | transformer_engine | full_iteration. Defaults to ``local``:
            choosing backend="cudagraph_modules" means you want capture (Megatron's own default is ``none``).
        cuda_graph_modules: tags whose regions are captured, in order of first appearance, deduplicated.
            Megatron's names (attn, mlp, moe, moe_router, moe_preprocess, mamba) are stored as
            :class:`CudaGraphModule` members, any other Python identifier as a plain custom tag.
            Empty means the whole layer: every capture-safe span.
        inference_cuda_graph_scope: none | layer | block. ``None`` picks the impl's default: ``layer`` for
            local, ``none`` otherwise (the only value those impls allow).
        cuda_graph_warmup_steps: eager calls before capture; 0 captures on the first call (warns).
        inner_compiler: eager runs the partition's own kernels; inductor fuses it before capture.
        driver: auto | cuda | emulate | eager; auto = cuda when the partition's tensors are on CUDA, else eager.
        min_partition_ops: capturable runs with fewer ops stay eager, since a replay has a fixed cost (>= 1).
        max_graphs_per_partition: graph-bank cap; past it the partition falls back to eager (>= 1).
        strict_modules: do not absorb untagged glue ops (residual adds, norms) into captured regions.
        strict: a selected region (e.g. moe) holding a data-dependent op raises instead of staying eager.
        clone_outputs: copy outputs leaving the compiled frame so the next replay cannot overwrite them.
        verify: run eager beside replay for this many steps and report the max difference (>= 0).
        dynamic_padding: off | max | buckets. ``max`` rewrites data-dependent index producers (nonzero,
            torch.where(mask), argwhere, boolean-mask indexing) to their static upper bound (nonzero_static)
            with a device-side count, so the rows they select can be captured without any host sync;
            ``buckets`` keeps one host read of the count and pads to the next bucket (one graph per bucket).
            Both are exact: padded rows are masked at the sum-like op that consumes them. Regions where that
            cannot be proven stay eager with reason ``not_paddable``.
        dynamic_padding_buckets: bucket sizes for ``buckets`` (positive, increasing); empty = powers of two.
            Counts above the largest bucket pad to the static upper bound.
        capture_sizes: batch-size buckets for serving (vLLM's approach), off when empty. With a dynamic batch
            dimension, each call's batch is padded up to the next size listed and the outputs sliced back, so
            a changing batch replays one graph per listed size; larger batches run eagerly (counted, logged
            once). Applied only where every op keeps the batch rows independent (the plan says why not).
            Positive ints, stored sorted and deduplicated; at most max_graphs_per_partition of them.
        te: keyword arguments passed through to Transformer Engine's make_graphed_callables (read-only;
            compared, not hashed).
        migrations: the deprecated spellings :meth:`from_options` rewrote (not compared, so a config
            rebuilt from :meth:`to_options` equals the original).
    """

    cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.LOCAL
    cuda_graph_modules: tuple[CudaGraphModule | str, ...] = ()
    inference_cuda_graph_scope: InferenceCudaGraphScope | None = None
    cuda_graph_warmup_steps: int = 3
    inner_compiler: InnerCompiler = InnerCompiler.EAGER
    driver: DriverKind = DriverKind.AUTO
    min_partition_ops: int = 2
    max_graphs_per_partition: int = 8
    strict_modules: bool = False
    strict: bool = False
    clone_outputs: bool = True
    verify: int = 0
    dynamic_padding: DynamicPadding = DynamicPadding.OFF
    dynamic_padding_buckets: tuple[int, ...] = ()
    capture_sizes: tuple[int, ...] = ()
    te: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _ReadOnlyMapping({}), hash=False)
    migrations: tuple[Migration, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        impl = _parse_enum("cuda_graph_impl", self.cuda_graph_impl, CudaGraphImpl)
        modules = _parse_modules("cuda_graph_modules", self.cuda_graph_modules, allow_deprecated=False)
        inference = self.inference_cuda_graph_scope
        if inference is not None:
            inference = _parse_enum("inference_cuda_graph_scope", inference, InferenceCudaGraphScope)
        normalized = {
            "cuda_graph_impl": impl,
            "cuda_graph_modules": modules,
            "inference_cuda_graph_scope": _check_combination(impl, modules, inference, spelled={}),
            "cuda_graph_warmup_steps": _parse_int("cuda_graph_warmup_steps", self.cuda_graph_warmup_steps, 0),
            "inner_compiler": _parse_enum("inner_compiler", self.inner_compiler, InnerCompiler),
            "driver": _parse_enum("driver", self.driver, DriverKind),
            "min_partition_ops": _parse_int("min_partition_ops", self.min_partition_ops, 1),
            "max_graphs_per_partition": _parse_int("max_graphs_per_partition", self.max_graphs_per_partition, 1),
            "strict_modules": _parse_bool("strict_modules", self.strict_modules),
            "strict": _parse_bool("strict", self.strict),
            "clone_outputs": _parse_bool("clone_outputs", self.clone_outputs),
            "verify": _parse_int("verify", self.verify, 0),
            "dynamic_padding": _parse_enum("dynamic_padding", self.dynamic_padding, DynamicPadding),
            "dynamic_padding_buckets": _parse_buckets(self.dynamic_padding_buckets),
            "capture_sizes": _parse_capture_sizes(self.capture_sizes, self.max_graphs_per_partition),
            "te": _parse_te(self.te),
            "migrations": _parse_migrations(self.migrations),
        }
        if normalized["dynamic_padding_buckets"] and normalized["dynamic_padding"] is not DynamicPadding.BUCKETS:
            raise ConfigError(
                f"dynamic_padding_buckets={list(normalized['dynamic_padding_buckets'])} only applies with "
                f"dynamic_padding='buckets', got dynamic_padding={normalized['dynamic_padding'].value!r}; "
                f"set dynamic_padding='buckets' or drop the buckets")
        for name, value in normalized.items():
            object.__setattr__(self, name, value)  # frozen: normalizing at construction is the one write
        if self.cuda_graph_warmup_steps == 0 and impl is not CudaGraphImpl.NONE:
            warnings.warn(
                "cuda_graph_warmup_steps=0: no warmup, graphs are captured on the first call; lazily "
                "initialized state (optimizer buffers, allocator caches, autotuning) may be captured "
                "half-built. Megatron's default is 3.",
                UserWarning,
                stacklevel=3,
            )

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | CudaGraphConfig | None = None) -> CudaGraphConfig:
        """Normalize ``torch.compile(..., options=...)`` into a config (a config is returned unchanged).

        Deprecated spellings are migrated with one FutureWarning each and recorded in ``migrations``;
        options whose value is None count as not given.
        """
        if options is None:
            return cls()
        if isinstance(options, CudaGraphConfig):
            return options
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"options must be a mapping of option name to value (or a CudaGraphConfig), "
                f"got {type(options).__name__}: {options!r}"
            )
        given = _known_options(options)
        fields = {name: value for name, value in given.items() if name not in _DEPRECATED_OPTIONS}
        migrations: list[Migration] = []
        # How each normalized field was spelled by the user, for error messages about migrated values.
        spelled: dict[str, str] = {}

        impl_flag = _migrate_impl_flags(given, migrations)
        if impl_flag is not None:
            flag, impl = impl_flag
            spelled["cuda_graph_impl"] = f"cuda_graph_impl={impl.value!r} (from {flag}=True)"
        else:
            impl = _parse_enum("cuda_graph_impl", given.get("cuda_graph_impl", CudaGraphImpl.LOCAL), CudaGraphImpl)
            if "cuda_graph_impl" not in given:
                spelled["cuda_graph_impl"] = f"cuda_graph_impl={impl.value!r} (the default)"
        fields["cuda_graph_impl"] = impl

        scope = _parse_modules("cuda_graph_scope", given.get("cuda_graph_scope", ()), allow_deprecated=True)
        if scope:  # an empty deprecated scope is Megatron's default: nothing to migrate
            _migrate_scope(scope, given, fields, spelled, migrations)

        modules = _parse_modules("cuda_graph_modules", fields.get("cuda_graph_modules", ()), allow_deprecated=False)
        inference = fields.get("inference_cuda_graph_scope")
        if inference is not None:
            inference = _parse_enum("inference_cuda_graph_scope", inference, InferenceCudaGraphScope)
        fields["inference_cuda_graph_scope"] = _check_combination(
            fields["cuda_graph_impl"], modules, inference, spelled
        )
        fields["cuda_graph_modules"] = modules

        config = cls(**fields, migrations=tuple(migrations))
        for migration in migrations:
            warnings.warn(
                f"deprecated option: {migration}. The old spelling still works but will be removed; "
                f"use the new one.",
                FutureWarning,
                stacklevel=2,
            )
        return config

    def to_options(self) -> dict[str, Any]:
        """The normalized options as plain strings, ints, bools, lists and dicts, new spellings only.

        ``from_options(config.to_options()) == config``.
        """
        return {
            field.name: _plain(getattr(self, field.name))
            for field in dataclasses.fields(self)
            if field.name != "migrations"
        }

    def to_json_dict(self) -> dict[str, Any]:
        """:meth:`to_options` made JSON-safe (``te`` values json cannot hold become their repr), plus the
        recorded migrations as readable strings."""
        options = self.to_options()
        options["te"] = _jsonable(options["te"])
        options["migrations"] = [str(migration) for migration in self.migrations]
        return options


# ---------------------------------------------------------------------------------------------------
# from_options steps


def _known_options(options: Mapping[Any, Any]) -> dict[str, Any]:
    """The given options minus None values; unknown names are rejected with a suggestion."""
    known = [field.name for field in dataclasses.fields(CudaGraphConfig) if field.name != "migrations"]
    for name in options:
        if not isinstance(name, str):
            raise ConfigError(f"option names must be strings, got {name!r} ({type(name).__name__})")
        if name not in known and name not in _DEPRECATED_OPTIONS:
            close = difflib.get_close_matches(name, known + list(_DEPRECATED_OPTIONS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ";"
            raise ConfigError(
                f"unknown option {name!r}{hint} valid options: {', '.join(known)} "
                f"(deprecated, still accepted: {', '.join(_DEPRECATED_OPTIONS)})"
            )
    return {name: value for name, value in options.items() if value is not None}


def _migrate_impl_flags(
    given: Mapping[str, Any], migrations: list[Migration]
) -> tuple[str, CudaGraphImpl] | None:
    """enable_cuda_graph=True -> local, external_cuda_graph=True -> transformer_engine; False is a no-op."""
    enable = _parse_bool("enable_cuda_graph", given.get("enable_cuda_graph", False))
    external = _parse_bool("external_cuda_graph", given.get("external_cuda_graph", False))
    if enable and external:
        raise ConfigError(
            "enable_cuda_graph=True and external_cuda_graph=True are two deprecated spellings of "
            "cuda_graph_impl that disagree ('local' vs 'transformer_engine'); set only "
            "cuda_graph_impl='local' or cuda_graph_impl='transformer_engine'"
        )
    if not (enable or external):
        return None
    flag, impl = ("enable_cuda_graph", CudaGraphImpl.LOCAL) if enable else (
        "external_cuda_graph", CudaGraphImpl.TRANSFORMER_ENGINE)
    if "cuda_graph_impl" in given:
        raise ConfigError(
            f"{flag}=True and cuda_graph_impl={given['cuda_graph_impl']!r} are the old and new spelling of "
            f"the same option; drop {flag} and keep cuda_graph_impl ({flag}=True means "
            f"cuda_graph_impl={impl.value!r})"
        )
    migrations.append(Migration(f"{flag}=True", f"cuda_graph_impl={impl.value!r}"))
    return flag, impl


def _migrate_scope(
    scope: tuple[CudaGraphModule | str, ...],
    given: Mapping[str, Any],
    fields: dict[str, Any],
    spelled: dict[str, str],
    migrations: list[Migration],
) -> None:
    """Rewrite a deprecated ``cuda_graph_scope`` into modules / impl / inference scope (design.md table)."""
    old = f"cuda_graph_scope={_show_list(scope)}"
    deprecated = [m for m in scope if isinstance(m, CudaGraphModule) and m.deprecated]
    modules = tuple(m for m in scope if m not in deprecated)
    fixes = "; ".join(f"{m.value!r}: {_DEPRECATED_SCOPE_FIXES[m]}" for m in deprecated)
    if "cuda_graph_modules" in given:
        raise ConfigError(
            f"{old} and cuda_graph_modules={given['cuda_graph_modules']!r} are the old and new spelling of "
            f"the same option; keep only cuda_graph_modules" + (f" ({fixes})" if fixes else "")
        )
    if len(deprecated) > 1:
        raise ConfigError(
            f"{old} combines deprecated values {_show_list(deprecated)} that mean different things; "
            f"keep one ({fixes})"
        )
    impl = fields["cuda_graph_impl"]
    impl_spelled = spelled.get("cuda_graph_impl", f"cuda_graph_impl={impl.value!r}")
    spelled["cuda_graph_modules"] = old
    value = deprecated[0] if deprecated else None

    if value is None:
        new = f"cuda_graph_modules={_show_list(modules)}"
    elif value is _M.FULL:
        if modules:
            raise ConfigError(
                f"{old}: 'full' (the whole layer) cannot be combined with other modules; use "
                f"cuda_graph_modules=[] for the whole layer, or cuda_graph_modules={_show_list(modules)} "
                f"for just those"
            )
        new = "cuda_graph_modules=[] (whole layer)"
    elif value is _M.FULL_ITERATION:
        if impl not in (CudaGraphImpl.LOCAL, CudaGraphImpl.FULL_ITERATION):
            raise ConfigError(
                f"{old} conflicts with {impl_spelled}: 'full_iteration' means cuda_graph_impl='full_iteration' "
                f"(whole-step capture), a different impl; set only cuda_graph_impl='full_iteration'"
            )
        if modules:
            raise ConfigError(
                f"{old}: cuda_graph_modules must be empty for full_iteration, which captures the whole step; "
                f"drop {_show_list(modules)}, or use cuda_graph_impl='local' with "
                f"cuda_graph_modules={_show_list(modules)} to capture only those"
            )
        fields["cuda_graph_impl"] = CudaGraphImpl.FULL_ITERATION
        spelled["cuda_graph_impl"] = f"cuda_graph_impl='full_iteration' (from {old})"
        new = "cuda_graph_impl='full_iteration'"
    else:  # full_iteration_inference
        if impl is not CudaGraphImpl.LOCAL:
            raise ConfigError(
                f"{old} conflicts with {impl_spelled}: 'full_iteration_inference' means local capture with "
                f"inference_cuda_graph_scope='block', which needs cuda_graph_impl='local'"
            )
        explicit = fields.get("inference_cuda_graph_scope")
        if explicit is not None:
            explicit_scope = _parse_enum("inference_cuda_graph_scope", explicit, InferenceCudaGraphScope)
            if explicit_scope is not InferenceCudaGraphScope.BLOCK:
                raise ConfigError(
                    f"{old} conflicts with inference_cuda_graph_scope={explicit_scope.value!r}: "
                    f"'full_iteration_inference' means inference_cuda_graph_scope='block'; drop one of them"
                )
        fields["inference_cuda_graph_scope"] = InferenceCudaGraphScope.BLOCK
        spelled["inference_cuda_graph_scope"] = f"inference_cuda_graph_scope='block' (from {old})"
        new = "inference_cuda_graph_scope='block'"
        if modules:
            new = f"cuda_graph_modules={_show_list(modules)}, {new}"
    fields["cuda_graph_modules"] = modules
    migrations.append(Migration(old, new))


def _check_combination(
    impl: CudaGraphImpl,
    modules: tuple[CudaGraphModule | str, ...],
    inference: InferenceCudaGraphScope | None,
    spelled: Mapping[str, str],
) -> InferenceCudaGraphScope:
    """Cross-option rules; returns the inference scope with the impl's default filled in."""
    impl_text = spelled.get("cuda_graph_impl", f"cuda_graph_impl={impl.value!r}")
    modules_text = spelled.get("cuda_graph_modules", f"cuda_graph_modules={_show_list(modules)}")
    if impl is CudaGraphImpl.FULL_ITERATION and modules:
        raise ConfigError(
            f"{modules_text} must be empty with {impl_text}, which captures the whole step; drop the modules, "
            f"or use cuda_graph_impl='local' to capture only those regions"
        )
    if _M.MOE in modules and _M.MOE_ROUTER in modules:
        raise ConfigError(
            f"{modules_text} selects both 'moe' and 'moe_router'; choose 'moe' (the whole MoE layer) or "
            f"'moe_router' (the router, optionally with 'moe_preprocess'), not both"
        )
    if _M.MOE_PREPROCESS in modules and _M.MOE_ROUTER not in modules:
        raise ConfigError(f"{modules_text}: 'moe_preprocess' requires 'moe_router'; add 'moe_router'")
    allowed = _ALLOWED_INFERENCE_SCOPES[impl]
    if inference is None:
        return allowed[0]
    if inference not in allowed:
        inference_text = spelled.get(
            "inference_cuda_graph_scope", f"inference_cuda_graph_scope={inference.value!r}"
        )
        raise ConfigError(
            f"{inference_text} is not allowed with {impl_text}; allowed: "
            f"{', '.join(repr(scope.value) for scope in allowed)}"
        )
    return inference


# ---------------------------------------------------------------------------------------------------
# value parsers: each names the option in its error


def _parse_enum(option: str, value: Any, enum_cls: type[_StrEnum]) -> Any:
    if isinstance(value, enum_cls):
        return value
    choices = enum_cls.choices()
    if isinstance(value, enum.Enum):  # someone else's enum (e.g. Megatron's): go by its value or name
        text = value.value if isinstance(value.value, str) else value.name
    elif isinstance(value, str):
        text = value
    else:
        raise ConfigError(
            f"{option} must be one of {', '.join(map(repr, choices))}, got {value!r} ({type(value).__name__})"
        )
    try:
        return enum_cls(text)
    except ValueError:
        close = difflib.get_close_matches(text.strip().lower(), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        raise ConfigError(
            f"{option}={text!r} is not a valid choice{hint} valid choices: {', '.join(map(repr, choices))}"
        ) from None


def _parse_modules(option: str, value: Any, *, allow_deprecated: bool) -> tuple[CudaGraphModule | str, ...]:
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
            text = item.value if isinstance(item.value, str) else item.name
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
            f"{option}: {member.value!r} is not a module but a deprecated cuda_graph_scope value; "
            f"{_DEPRECATED_SCOPE_FIXES[member]}"
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


def _parse_int(option: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        number = None
    else:
        try:
            number = operator.index(value)
        except TypeError:
            number = None
    if number is None:
        raise ConfigError(f"{option} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})")
    if number < minimum:
        raise ConfigError(f"{option} must be >= {minimum}, got {number}")
    return number


def _parse_bool(option: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{option} must be True or False, got {value!r} ({type(value).__name__})")


def _parse_buckets(value: Any) -> tuple[int, ...]:
    """Bucket sizes: a list/tuple (or comma-separated string) of positive integers, strictly increasing."""
    if isinstance(value, str):
        value = [item.strip() for item in value.split(",") if item.strip()]
        try:
            value = [int(item) for item in value]
        except ValueError:
            raise ConfigError(f"dynamic_padding_buckets must be positive integers, got {value!r}") from None
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"dynamic_padding_buckets must be a list of positive integers, got {value!r} "
                          f"({type(value).__name__})")
    sizes = tuple(_parse_int("dynamic_padding_buckets", item, 1) for item in value)
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ConfigError(f"dynamic_padding_buckets must be strictly increasing, got {list(sizes)}")
    return sizes


def _parse_capture_sizes(value: Any, max_graphs: Any) -> tuple[int, ...]:
    """A list or tuple of positive batch sizes -> sorted, deduplicated tuple (one graph each)."""
    form = "a list of positive batch sizes, e.g. [1, 2, 4, 8]"
    if not isinstance(value, (list, tuple)) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
        raise ConfigError(f"capture_sizes must be {form} (empty: off), got {value!r}")
    sizes = tuple(sorted(set(value)))
    if isinstance(max_graphs, int) and len(sizes) > max_graphs:
        raise ConfigError(f"capture_sizes={list(sizes)} needs {len(sizes)} graphs per partition, but "
                          f"max_graphs_per_partition={max_graphs}; raise max_graphs_per_partition to at least "
                          f"{len(sizes)} or list fewer sizes")
    return sizes


def _parse_te(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"te must be a mapping of make_graphed_callables keyword arguments, got {value!r} "
            f"({type(value).__name__})"
        )
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"te keys must be keyword-argument names (strings), got {key!r}")
    return value if isinstance(value, _ReadOnlyMapping) else _ReadOnlyMapping(value)


def _parse_migrations(value: Any) -> tuple[Migration, ...]:
    migrations = tuple(value) if isinstance(value, (list, tuple)) else None
    if migrations is None or not all(isinstance(m, Migration) for m in migrations):
        raise ConfigError(f"migrations must be a tuple of Migration, got {value!r}")
    return migrations


# ---------------------------------------------------------------------------------------------------
# display helpers


def _plain(value: Any) -> Any:
    """Enums -> their string, tuples -> lists, mappings -> dicts (for to_options)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return dict(value)
    return value


def _show_list(items: Sequence[CudaGraphModule | str]) -> str:
    return repr([_plain(item) for item in items])


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return _plain(value)
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return repr(value)

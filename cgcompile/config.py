"""Backend options -> one normalized, frozen :class:`CudaGraphConfig`.

Megatron-LM's CUDA-graph vocabulary is the public surface. Its options, deprecated spellings and rules
live in :mod:`cgcompile.megatron_flags` (each rewrite a :class:`Migration` record on the config, a
FutureWarning for a deprecated spelling), so the rest of cgcompile only ever sees the new spelling; this
module adds cgcompile's own options and the frozen config. Every invalid or contradictory input raises one
:class:`~cgcompile.errors.ConfigError` whose message names the option, the value and the fix.

Pure on purpose: no torch import, no tracing, no global state, so it can be tested and reused alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from .config_values import ChoiceEnum, parse_bool, parse_enum, parse_int, plain
from .errors import ConfigError
from .megatron_flags import (
    DEPRECATED_OPTIONS,
    CudaGraphImpl,
    CudaGraphModule,
    CudaGraphScope,
    InferenceCudaGraphScope,
    Migration,
    check_combination,
    normalize_megatron_options,
    parse_modules,
)

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
    "MeasureBenefit",
    "Migration",
]


class DriverKind(ChoiceEnum):
    """How captured partitions execute: real CUDA graphs, a CPU emulation of capture/replay, or eager."""

    AUTO = "auto"
    CUDA = "cuda"
    EMULATE = "emulate"
    EAGER = "eager"


class DynamicPadding(ChoiceEnum):
    """How data-dependent row counts (nonzero, torch.where(mask), boolean masks) are made capturable."""

    OFF = "off"
    MAX = "max"
    BUCKETS = "buckets"


class InnerCompiler(ChoiceEnum):
    """What runs inside a captured partition: its own kernels, Inductor-fused ones, or (auto) Inductor's where
    real CUDA graphs are captured and the partition's own kernels elsewhere."""

    AUTO = "auto"
    EAGER = "eager"
    INDUCTOR = "inductor"


class MeasureBenefit(ChoiceEnum):
    """Whether captured partitions are timed against their eager calls (a replay that does not pay goes eager)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


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
    """The backend's options, normalized and validated; build it with `from_options`.

    Direct construction normalizes and validates too (strings, names and lists become enums and tuples),
    but only `from_options` understands the deprecated option names. Each attribute below is one option of
    `torch.compile(..., options={...})` (the docs' option table is generated from this list).

    Attributes:
        cuda_graph_impl: none | local | transformer_engine | full_iteration. Defaults to ``local``:
            choosing backend="cudagraph_modules" means you want capture (Megatron's own default is ``none``).
        cuda_graph_modules: tags whose regions are captured, in order of first appearance, deduplicated.
            Megatron's names (attn, mlp, moe, moe_router, moe_preprocess, mamba) are stored as
            `CudaGraphModule` members, any other Python identifier as a plain custom tag.
            Empty means the whole layer: every capture-safe span.
        inference_cuda_graph_scope: what no-grad (inference) graphs capture: none | layer (per partition,
            forward-only graphs) | block (maximal capture-safe spans across module boundaries). ``None`` picks
            the impl's default: ``layer`` for local, ``none`` otherwise (the only value those impls allow).
        cuda_graph_warmup_steps: eager calls before capture; 0 captures on the first call (warns).
        inner_compiler: auto | eager | inductor. eager runs the partition's own kernels; inductor fuses it
            before capture (more compile time, fewer and fused kernels); auto = inductor for partitions the
            cuda driver captures, eager elsewhere (emulate, eager driver, CPU tensors). On an H200 the fused
            partitions matched reduce-overhead's step time where eager inner ran at 0.74-0.75x of it
            (docs/benchmarks.md, GPU results).
        driver: auto | cuda | emulate | eager. cuda captures real CUDA graphs; emulate is a CPU emulation with
            CUDA-graph buffer semantics (for tests); eager runs every partition eagerly; auto = cuda when the
            partition's tensors are on CUDA, else eager.
        min_partition_ops: capturable runs with fewer ops stay eager, since a replay has a fixed cost (>= 1).
            In whole-layer mode a small run first joins its captured neighbour across the layer cut, so
            `nn.Sequential(Linear, GELU, Linear)` is one graph.
        max_graphs_per_partition: graph-bank cap (shapes, instances) per parameter set (>= 1); past it the
            call runs eagerly, logged once. The bank also releases graphs that are not replayed and stops
            capturing sizes that do not repeat.
        strict_modules: do not absorb untagged glue ops (residual adds, norms) into captured regions and do
            not merge regions: one graph per tagged module instance.
        strict: a selected region (e.g. moe) holding an uncapturable op raises instead of staying eager.
        clone_outputs: copy outputs leaving the compiled frame out of graph memory, so the next replay cannot
            overwrite them.
        verify: for this many calls after warmup, run eager beside each captured partition and report the
            largest difference (`cgcompile.stats()["verify_max_diff"]`, an INFO log line) (>= 0).
        dynamic_padding: off | max | buckets: capture the rows a data-dependent index op selects (the MoE
            expert loop), exactly. ``max`` rewrites data-dependent index producers (nonzero,
            torch.where(mask), argwhere, boolean-mask indexing) to their static upper bound (nonzero_static)
            with a device-side count, so the rows they select can be captured without any host sync;
            ``buckets`` keeps one host read of the count and pads to the next bucket (one graph per bucket).
            Both are exact: padded rows are masked at the sum-like op that consumes them. Regions where that
            cannot be proven stay eager with reason ``not_paddable``.
        dynamic_padding_buckets: bucket sizes for ``buckets`` (positive, increasing); empty = powers of two.
            Counts above the largest bucket pad to the static upper bound.
        capture_sizes: the batch sizes to capture for serving (vLLM's approach), off when empty. With a dynamic batch
            dimension, each call's batch is padded up to the next size listed and the outputs sliced back, so
            a changing batch replays one graph per listed size; larger batches run eagerly (counted, logged
            once). Applied only where every op keeps the batch rows independent (the plan says why not).
            Positive ints, stored sorted and deduplicated; at most max_graphs_per_partition of them.
        fsdp_keep_unsharded: FSDP2 parameters of fully_shard(reshard_after_forward=True) groups: keep them
            unsharded between uses so the graphs reading them are captured (their unsharded bytes stay resident
            on every rank, logged). Off: those graphs are planned eager (reason ``fsdp_resharded_params``).
            Groups with reshard_after_forward=False are always kept (no extra peak memory).
        measure_benefit: auto | on | off: time each captured partition's eager warmup calls and its first
            replays after capture (CUDA events on a GPU; a host clock on the CPU drivers); a partition whose
            replay, input copies included, is not faster than its eager call by 5% runs eagerly from then on
            (reason ``not_profitable``, both times named). ``auto`` is on with the cuda driver only, where a GPU
            measures it, and with a memory budget. Megatron has no such rule.
        cuda_graph_memory_budget: what all graphs of the model (its compiled frames with these options) may
            hold: bytes (an int >= 1) or a fraction of the device's memory (a float in (0, 1]; the host's RAM
            off CUDA); None: no budget. A capture that would pass it first releases the least-used graphs of its
            partition and the graphs of partitions saving less time per byte; otherwise it stays eager (reason
            ``memory_budget``, the bytes named). Megatron has no such budget.
        te: keyword arguments passed through to Transformer Engine's make_graphed_callables (read-only;
            compared, not hashed).
        migrations: the deprecated spellings `from_options` rewrote (not compared, so a config
            rebuilt from `to_options` equals the original). A record, not an option.
    """

    cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.LOCAL
    cuda_graph_modules: tuple[CudaGraphModule | str, ...] = ()
    inference_cuda_graph_scope: InferenceCudaGraphScope | None = None
    cuda_graph_warmup_steps: int = 3
    inner_compiler: InnerCompiler = InnerCompiler.AUTO
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
    fsdp_keep_unsharded: bool = False
    measure_benefit: MeasureBenefit = MeasureBenefit.AUTO
    cuda_graph_memory_budget: int | float | None = None
    te: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _ReadOnlyMapping({}), hash=False)
    migrations: tuple[Migration, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        impl = parse_enum("cuda_graph_impl", self.cuda_graph_impl, CudaGraphImpl)
        modules = parse_modules("cuda_graph_modules", self.cuda_graph_modules, allow_deprecated=False)
        inference = self.inference_cuda_graph_scope
        if inference is not None:
            inference = parse_enum("inference_cuda_graph_scope", inference, InferenceCudaGraphScope)
        modules, inference, rewrites = check_combination(impl, modules, inference, spelled={})
        normalized = {
            "cuda_graph_impl": impl,
            "cuda_graph_modules": modules,
            "inference_cuda_graph_scope": inference,
            "cuda_graph_warmup_steps": parse_int("cuda_graph_warmup_steps", self.cuda_graph_warmup_steps, 0),
            "inner_compiler": parse_enum("inner_compiler", self.inner_compiler, InnerCompiler),
            "driver": parse_enum("driver", self.driver, DriverKind),
            "min_partition_ops": parse_int("min_partition_ops", self.min_partition_ops, 1),
            "max_graphs_per_partition": parse_int("max_graphs_per_partition", self.max_graphs_per_partition, 1),
            "strict_modules": parse_bool("strict_modules", self.strict_modules),
            "strict": parse_bool("strict", self.strict),
            "clone_outputs": parse_bool("clone_outputs", self.clone_outputs),
            "verify": parse_int("verify", self.verify, 0),
            "dynamic_padding": parse_enum("dynamic_padding", self.dynamic_padding, DynamicPadding),
            "dynamic_padding_buckets": _parse_buckets(self.dynamic_padding_buckets),
            "capture_sizes": _parse_capture_sizes(self.capture_sizes, self.max_graphs_per_partition),
            "fsdp_keep_unsharded": parse_bool("fsdp_keep_unsharded", self.fsdp_keep_unsharded),
            "measure_benefit": parse_enum("measure_benefit", self.measure_benefit, MeasureBenefit),
            "cuda_graph_memory_budget": _parse_budget(self.cuda_graph_memory_budget),
            "te": _parse_te(self.te),
            "migrations": _parse_migrations(self.migrations) + tuple(rewrites),
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

    def fuses_with_inductor(self, driver_name: str) -> bool:
        """Is a partition run by the driver named `driver_name` compiled by Inductor before capture?"""
        if self.inner_compiler is InnerCompiler.AUTO:
            return driver_name == DriverKind.CUDA.value
        return self.inner_compiler is InnerCompiler.INDUCTOR

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | CudaGraphConfig | None = None) -> CudaGraphConfig:
        """Normalize ``torch.compile(..., options=...)`` into a config (a config is returned unchanged).

        Megatron's deprecated spellings are migrated with one FutureWarning each, and every rewrite (also
        the local impl's moe_router/moe_preprocess pairing, which Megatron-Core makes silently) is recorded
        in ``migrations``; options whose value is None count as not given.
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
        fields = {name: value for name, value in given.items() if name not in DEPRECATED_OPTIONS}
        megatron_fields, migrations = normalize_megatron_options(given)
        fields.update(megatron_fields)
        config = cls(**fields, migrations=tuple(migrations))
        for migration in (m for m in migrations if m.deprecated):
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
            field.name: plain(getattr(self, field.name))
            for field in dataclasses.fields(self)
            if field.name != "migrations"
        }

    def to_json_dict(self) -> dict[str, Any]:
        """`to_options` made JSON-safe (``te`` values json cannot hold become their repr), plus the
        recorded migrations as readable strings."""
        options = self.to_options()
        options["te"] = _jsonable(options["te"])
        options["migrations"] = [str(migration) for migration in self.migrations]
        return options


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
    sizes = tuple(parse_int("dynamic_padding_buckets", item, 1) for item in value)
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


def _parse_budget(value: Any) -> int | float | None:
    """Graph-memory budget: None (off), bytes (int >= 1) or a fraction of the device's memory (float in (0, 1])."""
    if value is None:
        return None
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ConfigError(f"cuda_graph_memory_budget={value!r} is not valid; valid values: None (no budget), bytes as "
                      f"an int >= 1 (e.g. 2 * 2**30), or a fraction of the device's memory as a float in (0, 1] "
                      f"(e.g. 0.2)")


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


def _known_options(options: Mapping[Any, Any]) -> dict[str, Any]:
    """The given options minus None values; unknown names are rejected with a suggestion."""
    known = [field.name for field in dataclasses.fields(CudaGraphConfig) if field.name != "migrations"]
    for name in options:
        if not isinstance(name, str):
            raise ConfigError(f"option names must be strings, got {name!r} ({type(name).__name__})")
        if name not in known and name not in DEPRECATED_OPTIONS:
            close = difflib.get_close_matches(name, known + list(DEPRECATED_OPTIONS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ";"
            raise ConfigError(
                f"unknown option {name!r}{hint} valid options: {', '.join(known)} "
                f"(deprecated, still accepted: {', '.join(DEPRECATED_OPTIONS)})"
            )
    return {name: value for name, value in options.items() if value is not None}


# ---------------------------------------------------------------------------------------------------
# display helpers


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return plain(value)
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return repr(value)

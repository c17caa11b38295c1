"""cgcompile.config: properties over generated option dicts (hypothesis): valid ones normalize idempotently,
arbitrary ones raise only ConfigError."""

from __future__ import annotations

import dataclasses
import json
import warnings

from hypothesis import given, settings
from hypothesis import strategies as st

from cgcompile.config import (
    CudaGraphConfig,
    CudaGraphImpl,
    DriverKind,
    InferenceCudaGraphScope,
    InnerCompiler,
)
from cgcompile.errors import ConfigError
from tests.config_checks import M, from_options


# --- properties ----------------------------------------------------------------------------------------

_CUSTOM = st.from_regex(r"blk_[a-z0-9_]{0,6}", fullmatch=True)


@st.composite
def _module_names(draw, names):
    """Render module names as a list, tuple, comma string, or enum members / upper-case names."""
    style = draw(st.sampled_from(["list", "tuple", "comma", "enum", "upper"]))
    if style == "comma":
        return ", ".join(str(n) for n in names) if names else draw(st.sampled_from(["", ","]))
    if style == "enum":
        items = [M(n) if n in M.choices() else n for n in names]
    elif style == "upper":
        items = [n.upper() if n in M.choices() else n for n in names]
    else:
        items = list(names)
    return tuple(items) if style == "tuple" else items


def _enum_spelling(value: str, enum_cls):
    return st.sampled_from([value, value.upper(), f" {value.title()} ", enum_cls(value)])


@st.composite
def valid_options(draw):
    """Option dicts that are valid by construction, mixing new and deprecated spellings."""
    options: dict = {}
    impl = draw(st.sampled_from([None, "none", "local", "transformer_engine", "full_iteration"]))
    flag = {"local": "enable_cuda_graph", "transformer_engine": "external_cuda_graph"}.get(impl)
    if flag and draw(st.booleans()):
        options[flag] = draw(st.sampled_from([True, 1]))
    elif impl is not None:
        options["cuda_graph_impl"] = draw(_enum_spelling(impl, CudaGraphImpl))
    effective_impl = impl or "local"

    modules: list[str] = []
    if effective_impl != "full_iteration":
        modules += draw(st.lists(st.sampled_from(["attn", "mlp", "mamba"]), unique=True))
        modules += draw(st.sampled_from([[], ["moe"], ["moe_router"], ["moe_router", "moe_preprocess"]]))
        modules += draw(st.lists(_CUSTOM, max_size=3))
        modules = draw(st.permutations(modules))
        if modules and draw(st.booleans()):
            modules.append(modules[0])  # duplicates are dropped
    use_scope = draw(st.booleans())
    inference_choices = {"local": ["layer", "block"]}.get(effective_impl, ["none"])
    if use_scope:
        scope = list(modules)
        extra = draw(st.sampled_from([None, "full", "full_iteration", "full_iteration_inference"]))
        if extra == "full" and not scope:
            scope.append("full")
        elif extra == "full_iteration" and not scope and effective_impl in ("local", "full_iteration"):
            scope.append("full_iteration")
            effective_impl, inference_choices = "full_iteration", ["none"]
        elif extra == "full_iteration_inference" and effective_impl == "local":
            scope.append("full_iteration_inference")
            inference_choices = ["block"]
        if scope or draw(st.booleans()):
            options["cuda_graph_scope"] = draw(_module_names(scope))
    elif modules or draw(st.booleans()):
        options["cuda_graph_modules"] = draw(_module_names(modules))
    if draw(st.booleans()):
        options["inference_cuda_graph_scope"] = draw(
            _enum_spelling(draw(st.sampled_from(inference_choices)), InferenceCudaGraphScope)
        )
    optional = {
        "cuda_graph_warmup_steps": st.integers(0, 5),
        "inner_compiler": st.sampled_from(InnerCompiler.choices()).flatmap(lambda v: _enum_spelling(v, InnerCompiler)),
        "driver": st.sampled_from(DriverKind.choices()).flatmap(lambda v: _enum_spelling(v, DriverKind)),
        "min_partition_ops": st.integers(1, 10),
        "max_graphs_per_partition": st.integers(1, 10),
        "strict_modules": st.sampled_from([True, False, 0, 1]),
        "strict": st.booleans(),
        "clone_outputs": st.booleans(),
        "verify": st.integers(0, 3),
        "dynamic_padding": st.sampled_from(["off", "max", "MAX"]),
        "te": st.dictionaries(st.sampled_from(["fp8", "fp8_recipe", "num_warmup_iters"]),
                              st.one_of(st.booleans(), st.integers(), st.text(max_size=4))),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            options[name] = draw(strategy)
    return options


def _quiet_from_options(options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return from_options(options)


@settings(max_examples=300, deadline=None)
@given(valid_options())
def test_valid_options_normalize_idempotently(options):
    config = _quiet_from_options(options)
    rebuilt = _quiet_from_options(config.to_options())
    assert rebuilt == config and hash(rebuilt) == hash(config)
    assert rebuilt.migrations == ()
    deprecated_used = "cuda_graph_scope" in options or any(
        options.get(k) for k in ("enable_cuda_graph", "external_cuda_graph"))
    assert any(m.deprecated for m in config.migrations) == bool(deprecated_used)
    json.dumps(config.to_json_dict())


_KEYS = [f.name for f in dataclasses.fields(CudaGraphConfig) if f.name != "migrations"] + [
    "enable_cuda_graph", "external_cuda_graph", "cuda_graph_scope",
]
_NAMES = st.sampled_from(M.choices() + CudaGraphImpl.choices() + InferenceCudaGraphScope.choices()
                         + DriverKind.choices() + ["atn", "blk_1", "LOCAL", "x y", ""])
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 12), st.floats(allow_nan=True), st.text(max_size=12), _NAMES,
    st.sampled_from(list(M) + list(CudaGraphImpl) + list(InferenceCudaGraphScope) + list(DriverKind)),
)
_VALUES = st.one_of(
    _SCALARS,
    st.lists(st.one_of(_NAMES, _SCALARS), max_size=5),
    st.lists(_NAMES, max_size=5).map(tuple),
    st.lists(_NAMES, max_size=5).map(", ".join),
    st.frozensets(_NAMES, max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), _SCALARS, max_size=3),
)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.one_of(st.sampled_from(_KEYS), st.text(max_size=10)), _VALUES, max_size=6))
def test_arbitrary_options_raise_only_config_error(options):
    try:
        config = _quiet_from_options(options)
    except ConfigError:
        return
    assert _quiet_from_options(config.to_options()) == config

"""cgcompile.config: option normalization, Megatron migrations and rejections."""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import pickle
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgcompile.config import (
    CudaGraphConfig,
    CudaGraphImpl,
    CudaGraphModule,
    CudaGraphScope,
    DriverKind,
    DynamicPadding,
    InferenceCudaGraphScope,
    InnerCompiler,
    Migration,
)
from cgcompile.errors import ConfigError

M = CudaGraphModule
from_options = CudaGraphConfig.from_options


def migrate(options):
    """from_options, asserting exactly one FutureWarning per recorded deprecated-spelling migration."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = from_options(options)
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    deprecated = [m for m in config.migrations if m.deprecated]
    assert len(future) == len(deprecated)
    for migration, message in zip(deprecated, future):
        assert str(migration) in message
    return config


def error_of(options) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError) as excinfo:
            from_options(options)
    return str(excinfo.value)


# --- enums -----------------------------------------------------------------------------------------


def test_enums_are_their_strings():
    assert CudaGraphImpl.LOCAL == "local"
    assert str(CudaGraphImpl.TRANSFORMER_ENGINE) == "transformer_engine"
    assert f"{InferenceCudaGraphScope.BLOCK}" == "block"
    assert DriverKind.EMULATE == "emulate" and InnerCompiler.INDUCTOR == "inductor"
    assert CudaGraphImpl("LOCAL") is CudaGraphImpl.LOCAL  # names, case-insensitively
    assert CudaGraphModule("Moe_Router") is M.MOE_ROUTER
    assert {"attn": 1}[M.ATTN] == 1
    assert isinstance(ConfigError("x"), ValueError)


def test_cuda_graph_scope_is_a_deprecated_alias_of_cuda_graph_module():
    assert CudaGraphScope is CudaGraphModule
    assert CudaGraphScope.ATTN == "attn"
    assert [m.value for m in M if m.deprecated] == ["full_iteration", "full_iteration_inference", "full"]


# --- defaults and accepted spellings ----------------------------------------------------------------


def test_defaults():
    config = from_options(None)
    assert config == CudaGraphConfig() == from_options({})
    assert config.cuda_graph_impl is CudaGraphImpl.LOCAL
    assert config.cuda_graph_modules == ()
    assert config.inference_cuda_graph_scope is InferenceCudaGraphScope.LAYER
    assert (config.cuda_graph_warmup_steps, config.min_partition_ops, config.max_graphs_per_partition) == (3, 2, 8)
    assert config.inner_compiler is InnerCompiler.AUTO and config.driver is DriverKind.AUTO
    assert (config.strict_modules, config.strict, config.clone_outputs, config.verify) == (False, False, True, 0)
    assert config.capture_sizes == ()
    assert CudaGraphConfig(capture_sizes=[8, 1, 4, 4]).capture_sizes == (1, 4, 8)  # sorted, deduplicated
    assert dict(config.te) == {} and config.migrations == ()


@pytest.mark.parametrize(
    "impl, inference",
    [("none", "none"), ("local", "layer"), ("transformer_engine", "none"), ("full_iteration", "none")],
)
def test_inference_scope_default_follows_impl(impl, inference):
    assert from_options({"cuda_graph_impl": impl}).inference_cuda_graph_scope == inference
    assert CudaGraphConfig(cuda_graph_impl=impl).inference_cuda_graph_scope == inference


@pytest.mark.parametrize(
    "modules",
    [
        "attn, mlp,moe_router , moe_preprocess",
        "attn,mlp,moe_router,moe_preprocess,",
        ["attn", "mlp", "moe_router", "moe_preprocess"],
        ("ATTN", "Mlp", "MOE_ROUTER", "moe_preprocess"),
        [M.ATTN, M.MLP, M.MOE_ROUTER, M.MOE_PREPROCESS],
        [M.ATTN, "mlp", "attn", M.MOE_ROUTER, "mlp", "moe_preprocess"],  # duplicates: first appearance wins
    ],
)
def test_module_spellings(modules):
    config = from_options({"cuda_graph_modules": modules})
    assert config.cuda_graph_modules == (M.ATTN, M.MLP, M.MOE_ROUTER, M.MOE_PREPROCESS)
    assert all(type(m) is CudaGraphModule for m in config.cuda_graph_modules)


def test_single_enum_member_and_foreign_enums_are_accepted():
    class MegatronStyle(enum.Enum):  # someone else's enum with non-string values: go by name
        attn = 1
        mlp = 2

    assert from_options({"cuda_graph_modules": M.MAMBA}).cuda_graph_modules == (M.MAMBA,)
    assert from_options({"cuda_graph_modules": [MegatronStyle.attn, MegatronStyle.mlp]}).cuda_graph_modules == (
        M.ATTN,
        M.MLP,
    )


@pytest.mark.parametrize("spelling", ["transformer_engine", "TRANSFORMER_ENGINE", " Transformer_Engine ",
                                      CudaGraphImpl.TRANSFORMER_ENGINE])
def test_enum_option_spellings(spelling):
    assert from_options({"cuda_graph_impl": spelling}).cuda_graph_impl is CudaGraphImpl.TRANSFORMER_ENGINE


def test_other_enum_options():
    config = from_options({"driver": "EMULATE", "inner_compiler": InnerCompiler.INDUCTOR,
                           "inference_cuda_graph_scope": "Block"})
    assert config.driver is DriverKind.EMULATE
    assert config.inner_compiler is InnerCompiler.INDUCTOR
    assert config.inference_cuda_graph_scope is InferenceCudaGraphScope.BLOCK


@pytest.mark.parametrize("choice, fused_on", [("auto", {"cuda"}), ("eager", set()),
                                               ("inductor", {"cuda", "emulate", "eager"})])
def test_inner_compiler_auto_fuses_only_what_the_cuda_driver_captures(choice, fused_on):
    config = from_options({"inner_compiler": choice})
    assert {d for d in ("cuda", "emulate", "eager") if config.fuses_with_inductor(d)} == fused_on


def test_custom_module_names_are_plain_strings():
    config = from_options({"cuda_graph_modules": ["my_block", "attn", "attn2", "x_attn", "mlp_1", "mamba2", "Head"]})
    assert config.cuda_graph_modules == ("my_block", M.ATTN, "attn2", "x_attn", "mlp_1", "mamba2", "Head")
    assert [type(m) for m in config.cuda_graph_modules] == [str, M, str, str, str, str, str]
    assert config.to_options()["cuda_graph_modules"] == ["my_block", "attn", "attn2", "x_attn", "mlp_1", "mamba2",
                                                         "Head"]


def test_booleans_accept_bool_and_0_1():
    config = from_options({"strict": 1, "strict_modules": True, "clone_outputs": 0, "fsdp_keep_unsharded": 1})
    flags = (config.strict, config.strict_modules, config.clone_outputs, config.fsdp_keep_unsharded)
    assert flags == (True, True, False, True)
    assert all(type(v) is bool for v in flags)
    assert error_of({"fsdp_keep_unsharded": "yes"}) == "fsdp_keep_unsharded must be True or False, got 'yes' (str)"


def test_none_values_count_as_not_given():
    assert from_options({"cuda_graph_scope": None, "cuda_graph_impl": None, "te": None}) == CudaGraphConfig()


def test_empty_deprecated_scope_is_still_the_deprecated_option():
    # Megatron-Core 0.19.2 warns for any cuda_graph_scope, [] included, and rejects it beside real modules
    config = migrate({"cuda_graph_scope": [], "cuda_graph_impl": "local"})
    assert config.cuda_graph_modules == () and [str(m) for m in config.migrations] == [
        "cuda_graph_scope=[] -> cuda_graph_modules=[]"]
    assert "old and new spelling" in error_of({"cuda_graph_scope": [], "cuda_graph_modules": ["attn"]})


@pytest.mark.parametrize("modules", [[], "full", "FULL"])
def test_scope_beside_megatrons_default_modules_is_migrated(modules):
    # an argument dump carries cuda_graph_modules at its default ([] or "full") beside the old cuda_graph_scope
    config = migrate({"cuda_graph_scope": ["attn"], "cuda_graph_modules": modules})
    assert config.cuda_graph_modules == (M.ATTN,)
    assert [str(m) for m in config.migrations] == ["cuda_graph_scope=['attn'] -> cuda_graph_modules=['attn']"]


@pytest.mark.parametrize("given", [["moe_router"], ["moe_preprocess"], ["attn", "moe_router"]])
def test_local_impl_pairs_moe_router_and_moe_preprocess(given):
    config = migrate({"cuda_graph_impl": "local", "cuda_graph_modules": given})
    expected = tuple(M(n) for n in given) + tuple(m for m in (M.MOE_ROUTER, M.MOE_PREPROCESS) if m.value not in given)
    assert config.cuda_graph_modules == expected
    (rewrite,) = config.migrations
    assert not rewrite.deprecated  # Megatron-Core pairs them silently: recorded, no FutureWarning
    assert str(rewrite).startswith(f"cuda_graph_modules={given!r} -> cuda_graph_modules={[m.value for m in expected]!r}")
    # other impls keep the selection as given, and transformer_engine still needs moe_router
    te = from_options({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "moe_router"]})
    assert te.cuda_graph_modules == (M.ATTN, M.MOE_ROUTER) and te.migrations == ()
    message = error_of({"cuda_graph_impl": "local", "cuda_graph_modules": ["moe", "moe_preprocess"]})
    assert "both 'moe' and 'moe_preprocess'" in message and "together with 'moe_router'" in message


def test_impl_none_keeps_the_modules_unchecked():
    # nothing is captured, so Megatron-Core skips the module rules; the plan still shows the selection
    for modules in (["moe", "moe_router"], ["moe_preprocess"]):
        config = migrate({"cuda_graph_impl": "none", "cuda_graph_modules": modules})
        assert [m.value for m in config.cuda_graph_modules] == modules and config.migrations == ()


@pytest.mark.parametrize(
    "options, expected, recorded",
    [
        ({"enable_cuda_graph": True, "cuda_graph_impl": "none"}, ("local", (), "layer"),
         ["enable_cuda_graph=True, cuda_graph_impl='none' (Megatron's default) -> cuda_graph_impl='local'"]),
        ({"external_cuda_graph": True, "cuda_graph_impl": "none"}, ("transformer_engine", (), "none"),
         ["external_cuda_graph=True, cuda_graph_impl='none' (Megatron's default) -> "
          "cuda_graph_impl='transformer_engine'"]),
        ({"cuda_graph_impl": "none", "cuda_graph_scope": ["full_iteration"]}, ("full_iteration", (), "none"),
         ["cuda_graph_scope=['full_iteration'] -> cuda_graph_impl='full_iteration'"]),
        ({"cuda_graph_impl": "none", "cuda_graph_scope": ["attn", "full_iteration_inference"]},
         ("none", (M.ATTN,), "none"),
         ["cuda_graph_scope=['attn', 'full_iteration_inference'] -> cuda_graph_modules=['attn'] "
          "(full_iteration_inference has no effect with cuda_graph_impl='none'; use cuda_graph_impl='local' "
          "with inference_cuda_graph_scope='block')"]),
    ],
)
def test_explicit_impl_none_counts_as_not_set(options, expected, recorded):
    config = migrate(options)
    assert (config.cuda_graph_impl, config.cuda_graph_modules, config.inference_cuda_graph_scope) == expected
    assert [str(m) for m in config.migrations] == recorded


@pytest.mark.parametrize(
    "options, expected, recorded",
    [
        ({"cuda_graph_impl": "local", "cuda_graph_modules": "full"}, ("local", (), "layer"),
         "cuda_graph_modules=['full'] -> cuda_graph_modules=[] (whole layer)"),
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["full"]},
         ("transformer_engine", (), "none"), "cuda_graph_modules=['full'] -> cuda_graph_modules=[] (whole layer)"),
        ({"cuda_graph_modules": ["full_iteration"]}, ("full_iteration", (), "none"),
         "cuda_graph_modules=['full_iteration'] -> cuda_graph_impl='full_iteration'"),
        ({"cuda_graph_modules": ["attn", "full_iteration_inference"]}, ("local", (M.ATTN,), "block"),
         "cuda_graph_modules=['attn', 'full_iteration_inference'] -> cuda_graph_modules=['attn'], "
         "inference_cuda_graph_scope='block'"),
    ],
)
def test_deprecated_values_in_cuda_graph_modules_are_migrated(options, expected, recorded):
    config = migrate(options)  # Megatron-Core 0.19.2's own default for cuda_graph_modules is still "full"
    assert (config.cuda_graph_impl, config.cuda_graph_modules, config.inference_cuda_graph_scope) == expected
    assert [str(m) for m in config.migrations] == [recorded]


def test_false_deprecated_flags_are_dropped_silently():
    config = migrate({"enable_cuda_graph": False, "external_cuda_graph": False, "cuda_graph_impl": "none"})
    assert config.cuda_graph_impl is CudaGraphImpl.NONE and config.migrations == ()


def test_direct_construction_normalizes():
    config = CudaGraphConfig(cuda_graph_impl="LOCAL", cuda_graph_modules="attn, custom", driver="cuda")
    assert config == from_options({"cuda_graph_modules": ["attn", "custom"], "driver": "cuda"})
    with pytest.raises(ConfigError, match="moe_preprocess' requires 'moe_router'"):
        CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_preprocess"])
    paired = CudaGraphConfig(cuda_graph_modules=["moe_preprocess"])  # the local impl selects the router pair
    assert paired.cuda_graph_modules == (M.MOE_PREPROCESS, M.MOE_ROUTER) and len(paired.migrations) == 1


# --- migration table (Megatron-LM's deprecated options) ----------------------------------------------------------


@pytest.mark.parametrize(
    "options, expected, recorded",
    [
        (
            {"enable_cuda_graph": True},
            {"cuda_graph_impl": "local", "cuda_graph_modules": (), "inference_cuda_graph_scope": "layer"},
            ["enable_cuda_graph=True -> cuda_graph_impl='local'"],
        ),
        (
            {"external_cuda_graph": True},
            {"cuda_graph_impl": "transformer_engine", "inference_cuda_graph_scope": "none"},
            ["external_cuda_graph=True -> cuda_graph_impl='transformer_engine'"],
        ),
        (
            {"cuda_graph_scope": ["attn", "mlp"]},
            {"cuda_graph_impl": "local", "cuda_graph_modules": (M.ATTN, M.MLP)},
            ["cuda_graph_scope=['attn', 'mlp'] -> cuda_graph_modules=['attn', 'mlp']"],
        ),
        (
            {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]},
            {"cuda_graph_impl": "full_iteration", "cuda_graph_modules": (), "inference_cuda_graph_scope": "none"},
            ["cuda_graph_scope=['full_iteration'] -> cuda_graph_impl='full_iteration'"],
        ),
        (
            {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration_inference"]},
            {"cuda_graph_impl": "local", "cuda_graph_modules": (), "inference_cuda_graph_scope": "block"},
            ["cuda_graph_scope=['full_iteration_inference'] -> inference_cuda_graph_scope='block'"],
        ),
        (
            {"cuda_graph_scope": ["attn", "moe_router", "moe_preprocess", "full_iteration_inference"]},
            {
                "cuda_graph_impl": "local",
                "cuda_graph_modules": (M.ATTN, M.MOE_ROUTER, M.MOE_PREPROCESS),
                "inference_cuda_graph_scope": "block",
            },
            [
                "cuda_graph_scope=['attn', 'moe_router', 'moe_preprocess', 'full_iteration_inference'] -> "
                "cuda_graph_modules=['attn', 'moe_router', 'moe_preprocess'], inference_cuda_graph_scope='block'"
            ],
        ),
        (
            {"cuda_graph_scope": ["full"]},
            {"cuda_graph_impl": "local", "cuda_graph_modules": (), "inference_cuda_graph_scope": "layer"},
            ["cuda_graph_scope=['full'] -> cuda_graph_modules=[] (whole layer)"],
        ),
        (  # Megatron's old spelling of whole-step capture: both deprecated keys, one warning each
            {"enable_cuda_graph": True, "cuda_graph_scope": "full_iteration"},
            {"cuda_graph_impl": "full_iteration", "cuda_graph_modules": ()},
            [
                "enable_cuda_graph=True -> cuda_graph_impl='local'",
                "cuda_graph_scope=['full_iteration'] -> cuda_graph_impl='full_iteration'",
            ],
        ),
        (  # deprecated module spellings: comma string, enum alias, names
            {"external_cuda_graph": 1, "cuda_graph_scope": [CudaGraphScope.ATTN, "MLP"]},
            {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": (M.ATTN, M.MLP)},
            [
                "external_cuda_graph=True -> cuda_graph_impl='transformer_engine'",
                "cuda_graph_scope=['attn', 'mlp'] -> cuda_graph_modules=['attn', 'mlp']",
            ],
        ),
    ],
)
def test_migration_table(options, expected, recorded):
    with pytest.warns(FutureWarning, match="deprecated option"):
        from_options(options)
    config = migrate(options)
    for name, value in expected.items():
        assert getattr(config, name) == value, name
    assert [str(m) for m in config.migrations] == recorded
    assert all(isinstance(m, Migration) for m in config.migrations)
    assert config.to_json_dict()["migrations"] == recorded
    # migrations are not compared: the config rebuilt from its new spelling is equal and migration-free
    rebuilt = migrate(config.to_options())
    assert rebuilt == config and rebuilt.migrations == ()
    assert "cuda_graph_scope" not in config.to_options()


def test_migration_str():
    migration = Migration("cuda_graph_scope=['full_iteration']", "cuda_graph_impl='full_iteration'")
    assert str(migration) == "cuda_graph_scope=['full_iteration'] -> cuda_graph_impl='full_iteration'"


def test_full_iteration_inference_with_explicit_block_is_consistent():
    config = migrate({"cuda_graph_scope": ["full_iteration_inference"], "inference_cuda_graph_scope": "block"})
    assert config.inference_cuda_graph_scope is InferenceCudaGraphScope.BLOCK


# --- rejections ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "impl, scope, allowed",
    [
        ("none", "layer", "allowed: 'none'"),
        ("local", "none", "allowed: 'layer', 'block'"),
        ("transformer_engine", "block", "allowed: 'none'"),
        ("full_iteration", "layer", "allowed: 'none'"),
    ],
)
def test_inference_scope_must_suit_impl(impl, scope, allowed):
    message = error_of({"cuda_graph_impl": impl, "inference_cuda_graph_scope": scope})
    assert f"inference_cuda_graph_scope={scope!r}" in message
    assert f"cuda_graph_impl={impl!r}" in message
    assert allowed in message


def test_inference_scope_message_names_the_deprecated_origin():
    message = error_of({"external_cuda_graph": True, "inference_cuda_graph_scope": "layer"})
    assert "cuda_graph_impl='transformer_engine' (from external_cuda_graph=True)" in message
    assert "allowed: 'none'" in message


@pytest.mark.parametrize(
    "options, fragments",
    [
        (
            {"cuda_graph_impl": "full_iteration", "cuda_graph_modules": ["attn"]},
            ["cuda_graph_modules=['attn']", "must be empty", "cuda_graph_impl='full_iteration'",
             "cuda_graph_impl='local'"],
        ),
        (
            {"cuda_graph_scope": ["attn", "full_iteration"]},
            ["cuda_graph_scope=['attn', 'full_iteration']", "must be empty for full_iteration", "drop ['attn']"],
        ),
        (
            {"cuda_graph_scope": ["full", "attn"]},
            ["cuda_graph_scope=['full', 'attn']", "'full'", "cannot be combined", "cuda_graph_modules=[]"],
        ),
        (
            {"cuda_graph_modules": ["moe", "moe_router"]},
            ["cuda_graph_modules=['moe', 'moe_router']", "both 'moe' and 'moe_router'", "not both"],
        ),
        (
            {"cuda_graph_scope": "moe,moe_router"},
            ["cuda_graph_scope=['moe', 'moe_router']", "both 'moe' and 'moe_router'"],
        ),
        (
            {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "moe_preprocess"]},
            ["cuda_graph_modules=['attn', 'moe_preprocess']", "'moe_preprocess' requires 'moe_router'",
             "add 'moe_router'"],
        ),
    ],
)
def test_module_rules(options, fragments):
    message = error_of(options)
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    "options, fragments",
    [
        (
            {"cuda_graph_scope": ["attn"], "cuda_graph_modules": ["mlp"]},
            ["cuda_graph_scope=['attn']", "cuda_graph_modules=['mlp']", "old and new spelling",
             "keep only cuda_graph_modules"],
        ),
        (
            {"cuda_graph_scope": ["full_iteration"], "cuda_graph_modules": ["attn"]},
            ["cuda_graph_scope=['full_iteration']", "keep only cuda_graph_modules",
             "cuda_graph_impl='full_iteration'"],
        ),
        (
            {"enable_cuda_graph": True, "cuda_graph_impl": "local"},
            ["enable_cuda_graph=True", "cuda_graph_impl='local'", "old and new spelling", "drop enable_cuda_graph"],
        ),
        (
            {"external_cuda_graph": True, "cuda_graph_impl": "full_iteration"},
            ["external_cuda_graph=True", "cuda_graph_impl='full_iteration'", "drop external_cuda_graph",
             "cuda_graph_impl='transformer_engine'"],
        ),
        (
            {"enable_cuda_graph": True, "external_cuda_graph": True},
            ["enable_cuda_graph=True", "external_cuda_graph=True", "disagree",
             "cuda_graph_impl='local' or cuda_graph_impl='transformer_engine'"],
        ),
        (
            {"cuda_graph_scope": ["full_iteration", "full_iteration_inference"]},
            ["cuda_graph_scope=['full_iteration', 'full_iteration_inference']", "keep one",
             "cuda_graph_impl='full_iteration'", "inference_cuda_graph_scope='block'"],
        ),
        (
            {"cuda_graph_scope": "full, full_iteration"},
            ["cuda_graph_scope=['full', 'full_iteration']", "keep one", "empty = whole layer"],
        ),
        (
            {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["full_iteration"]},
            ["cuda_graph_scope=['full_iteration']", "conflicts with cuda_graph_impl='transformer_engine'",
             "set only cuda_graph_impl='full_iteration'"],
        ),
        (
            {"cuda_graph_impl": "full_iteration", "cuda_graph_scope": ["full_iteration_inference"]},
            ["cuda_graph_scope=['full_iteration_inference']", "conflicts with cuda_graph_impl='full_iteration'",
             "needs cuda_graph_impl='local'"],
        ),
        (
            {"external_cuda_graph": True, "cuda_graph_scope": ["full_iteration_inference"]},
            ["conflicts with cuda_graph_impl='transformer_engine' (from external_cuda_graph=True)"],
        ),
        (
            {"cuda_graph_scope": ["full_iteration_inference"], "inference_cuda_graph_scope": "layer"},
            ["cuda_graph_scope=['full_iteration_inference']", "conflicts with inference_cuda_graph_scope='layer'",
             "inference_cuda_graph_scope='block'"],
        ),
        (
            {"cuda_graph_scope": ["full_iteration"], "inference_cuda_graph_scope": "block"},
            ["inference_cuda_graph_scope='block'",
             "cuda_graph_impl='full_iteration' (from cuda_graph_scope=['full_iteration'])", "allowed: 'none'"],
        ),
    ],
)
def test_old_and_new_spellings_conflict(options, fragments):
    message = error_of(options)
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    "value, fix",
    [
        ("full_iteration", "cuda_graph_impl='full_iteration'"),
        ("full_iteration_inference", "inference_cuda_graph_scope='block'"),
        ("full", "leave cuda_graph_modules empty"),
    ],
)
def test_deprecated_values_are_not_modules_of_a_directly_built_config(value, fix):
    with pytest.raises(ConfigError) as excinfo:
        CudaGraphConfig(cuda_graph_modules=["attn", value])
    message = str(excinfo.value)
    assert "cuda_graph_modules" in message and repr(value) in message and fix in message


def test_unknown_option_suggests_the_close_one():
    message = error_of({"cuda_graph_modlues": ["attn"]})
    assert "unknown option 'cuda_graph_modlues'; did you mean 'cuda_graph_modules'?" in message
    assert "valid options: cuda_graph_impl, cuda_graph_modules" in message
    assert "cuda_graph_scope" in message  # deprecated names are listed as still accepted
    assert "did you mean" not in error_of({"zzz": 1})
    assert "unknown option 'mode'" in error_of({"mode": "max-autotune"})  # the backend strips mode first


@pytest.mark.parametrize(
    "option, value, suggestion",
    [
        ("cuda_graph_impl", "locl", "local"),
        ("cuda_graph_impl", "transformer-engine", "transformer_engine"),
        ("inference_cuda_graph_scope", "blok", "block"),
        ("driver", "emulat", "emulate"),
        ("inner_compiler", "inducter", "inductor"),
    ],
)
def test_misspelled_enum_values(option, value, suggestion):
    message = error_of({option: value})
    assert f"{option}={value!r}" in message
    assert f"did you mean {suggestion!r}?" in message
    assert "valid choices:" in message


@pytest.mark.parametrize(
    "option, typo, suggestion",
    [
        ("cuda_graph_modules", "atn", "attn"),
        ("cuda_graph_modules", "moe_routr", "moe_router"),
        ("cuda_graph_modules", "moe-router", "moe_router"),  # not an identifier, but clearly a typo
        ("cuda_graph_modules", "mambaa", "mamba"),
        ("cuda_graph_scope", "full_iteraton", "full_iteration"),
    ],
)
def test_near_miss_module_names_are_typos_not_custom_tags(option, typo, suggestion):
    message = error_of({option: ["mlp", typo]})
    assert option in message and repr(typo) in message
    assert f"did you mean {suggestion!r}?" in message
    assert "'attn', 'mlp', 'moe', 'moe_router', 'moe_preprocess', 'mamba'" in message


@pytest.mark.parametrize("name", ["my block", "2nd_block", "a.b", ""])
def test_custom_module_names_must_be_identifiers(name):
    message = error_of({"cuda_graph_modules": [name]})
    assert "cuda_graph_modules" in message and repr(name) in message
    assert "valid Python identifier" in message


@pytest.mark.parametrize(
    "options, fragments",
    [
        ({"cuda_graph_warmup_steps": -1}, ["cuda_graph_warmup_steps", ">= 0", "-1"]),
        ({"cuda_graph_warmup_steps": "three"}, ["cuda_graph_warmup_steps", "'three'", "integer"]),
        ({"cuda_graph_warmup_steps": True}, ["cuda_graph_warmup_steps", "True", "integer"]),
        ({"cuda_graph_warmup_steps": 2.5}, ["cuda_graph_warmup_steps", "2.5"]),
        ({"min_partition_ops": 0}, ["min_partition_ops", ">= 1", "0"]),
        ({"max_graphs_per_partition": 0}, ["max_graphs_per_partition", ">= 1"]),
        ({"verify": -2}, ["verify", ">= 0", "-2"]),
        ({"capture_sizes": [4, 0]}, ["capture_sizes", "[4, 0]", "positive batch sizes, e.g. [1, 2, 4, 8]"]),
        ({"capture_sizes": 8}, ["capture_sizes", "got 8", "a list of positive batch sizes"]),
        ({"capture_sizes": [1, 2.5]}, ["capture_sizes", "2.5"]),
        ({"capture_sizes": [1, 2, 4], "max_graphs_per_partition": 2},
         ["capture_sizes=[1, 2, 4]", "max_graphs_per_partition=2", "at least 3"]),
        ({"strict": "yes"}, ["strict", "'yes'", "True or False"]),
        ({"clone_outputs": 2}, ["clone_outputs", "2", "True or False"]),
        ({"enable_cuda_graph": "true"}, ["enable_cuda_graph", "'true'", "True or False"]),
        ({"cuda_graph_impl": 1}, ["cuda_graph_impl", "1", "'local'"]),
        ({"te": ["fp8"]}, ["te", "mapping", "['fp8']"]),
        ({"te": {1: "x"}}, ["te keys", "1"]),
        ({"cuda_graph_modules": {"attn", "mlp"}}, ["cuda_graph_modules", "use a list"]),
        ({"cuda_graph_modules": ["attn", 3]}, ["cuda_graph_modules", "3", "strings"]),
        ({"cuda_graph_scope": 7}, ["cuda_graph_scope", "7", "comma-separated"]),
        ({1: "x"}, ["option names must be strings", "1"]),
        ({"dynamic_padding": "maxx"}, ["dynamic_padding", "'maxx'", "did you mean 'max'", "'buckets'"]),
        ({"dynamic_padding": "buckets", "dynamic_padding_buckets": [8, 4]},
         ["dynamic_padding_buckets", "strictly increasing", "[8, 4]"]),
        ({"dynamic_padding": "buckets", "dynamic_padding_buckets": [0, 4]}, ["dynamic_padding_buckets", ">= 1", "0"]),
        ({"dynamic_padding": "buckets", "dynamic_padding_buckets": 8}, ["dynamic_padding_buckets", "list", "8"]),
        ({"dynamic_padding": "buckets", "dynamic_padding_buckets": "4,x"}, ["dynamic_padding_buckets", "'x'"]),
        ({"dynamic_padding_buckets": [4, 8]}, ["dynamic_padding_buckets=[4, 8]", "dynamic_padding='buckets'",
                                               "dynamic_padding='off'"]),
    ],
)
def test_wrong_types_and_ranges_name_the_option(options, fragments):
    message = error_of(options)
    for fragment in fragments:
        assert fragment in message


def test_options_must_be_a_mapping():
    assert "options must be a mapping" in error_of(["cuda_graph_impl", "local"])


def test_warmup_zero_warns_negative_rejected():
    with pytest.warns(UserWarning, match="no warmup"):
        config = from_options({"cuda_graph_warmup_steps": 0})
    assert config.cuda_graph_warmup_steps == 0
    with pytest.raises(ConfigError, match="cuda_graph_warmup_steps must be >= 0, got -3"):
        from_options({"cuda_graph_warmup_steps": -3})


# --- value semantics ---------------------------------------------------------------------------------


def test_frozen():
    config = CudaGraphConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cuda_graph_impl = CudaGraphImpl.NONE  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.te["fp8"] = True  # type: ignore[index]


def test_te_is_a_read_only_copy_compared_but_not_hashed():
    recipe = {"fp8": True, "fp8_recipe": object()}
    config = from_options({"te": recipe})
    recipe["fp8"] = False
    assert config.te["fp8"] is True
    assert config == from_options({"te": dict(config.te)})
    assert config != from_options({"te": {"fp8": True}})
    assert hash(config) == hash(from_options({"te": {"fp8": False}}))  # te is excluded from the hash
    json.dumps(config.to_json_dict())  # the object value becomes its repr


def test_dynamic_padding_options_normalize():
    config = from_options({"dynamic_padding": "Buckets", "dynamic_padding_buckets": "16, 64,256"})
    assert config.dynamic_padding is DynamicPadding.BUCKETS and config.dynamic_padding_buckets == (16, 64, 256)
    assert from_options(config.to_options()) == config
    assert from_options({}).dynamic_padding is DynamicPadding.OFF


def test_to_options_round_trip_and_json():
    config = migrate({"cuda_graph_scope": "attn,mlp", "driver": "emulate", "te": {"fp8": True}, "verify": 2})
    options = config.to_options()
    assert options == {
        "cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": "layer",
        "cuda_graph_warmup_steps": 3, "inner_compiler": "auto", "driver": "emulate", "min_partition_ops": 2,
        "max_graphs_per_partition": 8, "strict_modules": False, "strict": False, "clone_outputs": True,
        "verify": 2, "capture_sizes": [], "te": {"fp8": True}, "dynamic_padding": "off", "dynamic_padding_buckets": [],
        "fsdp_keep_unsharded": False, "measure_benefit": "auto", "cuda_graph_memory_budget": None,
    }
    assert all(type(v) is str for v in options["cuda_graph_modules"])
    assert type(options["cuda_graph_impl"]) is str
    assert json.loads(json.dumps(config.to_json_dict())) == {
        **options, "migrations": ["cuda_graph_scope=['attn', 'mlp'] -> cuda_graph_modules=['attn', 'mlp']"]
    }
    assert from_options(options) == config
    assert from_options(config) is config


def test_pickle_and_deepcopy():
    config = migrate({"cuda_graph_scope": ["full"], "te": {"fp8": True}})
    for clone in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        assert clone == config and clone.migrations == config.migrations and hash(clone) == hash(config)


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

"""cgcompile.config: option normalization, Megatron migrations, value semantics (rejections:
test_config_rejections.py; properties over generated options: test_config_properties.py)."""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import pickle

import pytest

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
from tests.config_checks import M, error_of, from_options, migrate


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

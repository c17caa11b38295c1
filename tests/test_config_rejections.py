"""cgcompile.config: bad options get one ConfigError naming the value and the valid choices."""

from __future__ import annotations

import pytest

from cgcompile.config import CudaGraphConfig
from cgcompile.errors import ConfigError
from tests.config_checks import error_of, from_options


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

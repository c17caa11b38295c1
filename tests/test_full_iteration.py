"""cuda_graph_impl="full_iteration": the whole frame as one graph, or one error listing everything in the way."""

import copy

import pytest
import torch

import cgcompile
from cgcompile import reset_stats, stats
from tests.models import MODELS, moe
from tests.parity import assert_step_matches_eager


def test_dense_model_is_one_graph_and_trains_like_eager():
    spec = MODELS["dense_gpt"]
    model = spec.make()
    reference = copy.deepcopy(model)
    options = {"cuda_graph_impl": "full_iteration", "driver": "emulate"}
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    (tokens,) = spec.example_inputs()
    plan = cgcompile.explain(model, tokens, options=options)
    assert [p.kind for g in plan.graphs for p in g.partitions] == ["capture"]
    reset_stats()
    for _ in range(5):
        assert_step_matches_eager(spec, compiled, model, reference, tokens)
        model.zero_grad(), reference.zero_grad()
    assert stats()["graphs_captured"] == 2  # one forward graph, one backward graph
    assert stats()["steady_replays"] == 2 * (5 - 3 - 1)  # after 3 warmup steps and the capture step


def test_moe_with_in_graph_dispatch_lists_the_blocking_line_with_hint():
    spec = MODELS["moe_mask"]
    compiled = torch.compile(spec.make(), backend="cudagraph_modules", options={"cuda_graph_impl": "full_iteration"})
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), pytest.raises(Exception) as info:
        compiled(*spec.example_inputs())
    text = str(info.value)
    (line,) = moe.dispatch_lines("mask")
    assert "cuda_graph_impl='full_iteration' needs the whole step in one graph" in text
    assert f"dynamic_shape torch.nonzero at {moe.SOURCE_FILE}:{line} in layers.0.moe -- set dynamic_padding='max'" in text
    assert "op(s) whose shapes depend on their results" in text


def test_moe_with_graph_break_names_the_break_line():
    spec = MODELS["moe_sort"]
    compiled = torch.compile(spec.make(), backend="cudagraph_modules", options={"cuda_graph_impl": "full_iteration"})
    with pytest.raises(Exception) as info:
        compiled(*spec.example_inputs())
    text = str(info.value)
    assert "Dynamo broke the graph at" in text
    assert any(f"{moe.SOURCE_FILE}:{line};" in text for line in moe.dispatch_lines("sort")), text

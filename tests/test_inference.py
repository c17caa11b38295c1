"""Inference scopes under torch.no_grad(): "layer" = forward-only graphs per partition, "block" = maximal
capture-safe spans ignoring module boundaries (emulate driver on CPU)."""

import pytest
import torch

import cgcompile
from cgcompile.backend import record_plans
from tests.models import MODELS


@pytest.mark.parametrize("scope, expected_graphs", [("layer", 2), ("block", 1)])
def test_no_grad_inference_scopes_capture_forward_only_graphs(scope, expected_graphs):
    spec = MODELS["dense_gpt"]
    model = spec.make().eval()
    options = spec.options(driver="emulate", inference_cuda_graph_scope=scope)
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    cgcompile.reset_stats()
    with torch.no_grad(), record_plans() as rec:
        for i in range(6):
            (tokens,) = spec.example_inputs(seed=i)
            torch.testing.assert_close(compiled(tokens), model(tokens), rtol=0, atol=0)
    (graph,) = rec.graphs
    assert graph.scope == scope and not graph.training
    assert len(graph.captured) == expected_graphs
    st = cgcompile.stats()
    assert st["graphs_captured"] == expected_graphs and st["steady_replays"] == expected_graphs * (6 - 3 - 1)


def test_moe_block_scope_spans_layers_between_dispatch_islands():
    spec = MODELS["moe_mask"]
    model = spec.make().eval()
    options = spec.options(driver="emulate", inference_cuda_graph_scope="block")
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    with torch.no_grad(), record_plans() as rec, \
            torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for i in range(5):
            (tokens,) = spec.example_inputs(seed=i)
            torch.testing.assert_close(compiled(tokens), model(tokens), rtol=1e-6, atol=1e-6)
    (graph,) = rec.graphs
    # a block may run from one layer's combine into the next layer's attention: module boundaries do not cut it
    assert any(p.module is None or p.module.count(".") == 0 for p in graph.captured)
    assert all("experts" not in (p.module or "") for p in graph.captured)

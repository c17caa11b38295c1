"""Dynamic shapes: backed sizes (dynamic=True, s0...) are captured once per concrete size; the Python numbers
Dynamo then passes as tensors (a LayerNorm eps) are read at the top of the graph and do not block capture."""

import copy

import torch

import cgcompile
from cgcompile.backend import record_plans
from tests.models import MODELS
from tests.parity import assert_step_matches_eager


def test_dynamic_true_captures_one_graph_per_size_and_matches_eager():
    spec = MODELS["dense_gpt"]
    model = spec.make()
    reference = copy.deepcopy(model)
    options = spec.options(driver="emulate", cuda_graph_warmup_steps=1)
    compiled = torch.compile(model, backend="cudagraph_modules", options=options, dynamic=True)
    cgcompile.reset_stats()
    lengths = [8, 6, 8, 6, 5, 8, 6, 5]
    with record_plans() as rec:
        for i, seq in enumerate(lengths):
            (tokens,) = spec.example_inputs(seq=seq, seed=i)
            assert_step_matches_eager(spec, compiled, model, reference, tokens)
    (graph,) = rec.graphs  # one Dynamo graph for every length
    assert [p.module for p in graph.captured] == ["layers.0", "layers.1"]
    first = graph.partitions[0]
    assert not first.captured and {r.category for r in first.reasons} == {"scalar_input"}
    assert first.tags == ()
    st = cgcompile.stats()
    # per size and partition one forward and one backward graph; the first call of each size is its warmup
    assert st["graphs_captured"] == 3 * 2 * 2 and st["eager_fallbacks"] == []
    # every call after each size's warmup and capture calls replays both graphs of both partitions
    assert st["steady_replays"] == (len(lengths) - 3 - 3) * 2 * 2

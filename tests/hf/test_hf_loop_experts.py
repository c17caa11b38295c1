"""The 4.x-style experts loop (a fixed `range(num_experts)` with `torch.where(mask[e])` and `index_add_`) on a
transformers 5 Mixtral: training matches eager with dynamic_padding off/max/buckets, and with max/buckets the
experts are captured.
(transformers 5's own eager loop iterates over a `nonzero()` result, a Dynamo break: see test_hf_explain.py.)"""

import types

import pytest
import torch
import torch.nn.functional as F

import cgcompile
from cgcompile.backend import record_plans
from tests.hf.families import build, train_like_eager


def loop_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers 4.x's Mixtral expert loop over transformers 5's 3-D expert weights."""
    out = torch.zeros_like(hidden_states)
    mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
    for e in range(self.num_experts):
        top, rows = torch.where(mask[e])
        gate, up = F.linear(hidden_states[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[rows, top, None]
        out.index_add_(0, rows, h.to(out.dtype))
    return out


@pytest.mark.parametrize("padding", ["off", "max", "buckets"])
def test_loop_experts_with_dynamic_padding_capture_and_match_eager(padding):
    model = build("mixtral", experts_implementation="eager")
    for layer in model.model.layers:
        layer.mlp.experts.forward = types.MethodType(loop_forward, layer.mlp.experts)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "cuda_graph_warmup_steps": 1, "dynamic_padding": padding})
    cgcompile.reset_stats()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), record_plans() as rec:
        loss_diffs, param_diff = train_like_eager(model, compiled, steps=4)
    assert max(loss_diffs) < 1e-5 and param_diff < 1e-5, (loss_diffs, param_diff)
    experts = [p for plan in rec.graphs for p in plan.partitions if p.captured
               and any("index_add" in n for n in p.nodes)]
    assert bool(experts) == (padding != "off"), padding  # off: the data-dependent rows keep it eager
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [] and st["graphs_captured"] >= 1 and st["steady_replays"] >= 3, st

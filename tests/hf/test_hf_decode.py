"""Greedy decode with transformers' StaticCache through the backend (Llama, Mixtral; emulate driver): tokens
equal eager's, logits within fp32 tolerance, graphs captured and replayed every step, layer and block scope,
and `capture_sizes` with a changing batch (HF's mask builder and `cache_position.expand(batch, 1)` included)."""

import copy

import pytest
import torch

import cgcompile
from cgcompile.backend import record_plans
from tests.hf.families import VOCAB, build, greedy_decode

STEPS, PROMPT = 9, 5  # 9 greedy tokens: the prefill's and 8 decode steps through the compiled model


@pytest.mark.parametrize("family, scope, sizes", [
    ("llama", "layer", []), ("llama", "block", []), ("llama", "block", [1, 2, 4]),
    ("mixtral", "layer", []), ("mixtral", "block", [1, 2, 4]),
])
def test_static_cache_decode_matches_eager(family, scope, sizes):
    model = build(family).eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules", options={
        "driver": "emulate", "inference_cuda_graph_scope": scope, "capture_sizes": sizes})
    batches = [2, 3] if sizes else [2]  # 3 pads to the captured size 4
    cgcompile.reset_stats()
    with record_plans() as rec:
        for batch in batches:
            prompt = torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
            got, got_logits = greedy_decode(model, compiled, prompt, STEPS)
            want, want_logits = greedy_decode(reference, reference, prompt, STEPS)
            assert torch.equal(got, want), (batch, got, want)
            torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [] and st["capture_size_overflows"] == 0
    warmup = 3
    assert st["graphs_captured"] > 0 and st["steady_replays"] >= len(batches) * (STEPS - 2 - warmup)
    refused = {(f.op, f.location.split("site-packages/")[-1].rsplit(":", 1)[0])
               for plan in rec.graphs if (f := plan.batch_padding_refused) is not None}
    if family == "mixtral" and sizes:
        # the grouped-mm experts flatten (batch, top_k) into one sorted token list: the exact blocker, named
        assert refused == {("Tensor.reshape", "transformers/integrations/moe.py")}, refused
    else:
        assert refused == set(), refused  # HF's mask builder (arange, expand) and dropout(p=0) keep rows apart
    if scope == "block" and family == "llama":
        assert all(len(plan.partitions) == 1 and plan.partitions[0].captured for plan in rec.graphs)

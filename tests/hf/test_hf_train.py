"""Hugging Face transformers 5 families trained through the backend (emulate driver, fp32 CPU, tiny configs):
the plan (what is captured, every island's reason at an HF file:line), parity with eager over 4 SGD steps with
new tokens every step, and graphs captured and replayed. One compiled run per family, shared by its asserts."""

import re

import pytest

import cgcompile
from cgcompile.backend import record_plans
from tests.hf.families import CONFIGS, MOE_FAMILIES, build, train_like_eager

# one warmup step: step 2 captures, steps 3 and 4 must replay what it captured
OPTIONS = {"cuda_graph_impl": "local", "driver": "emulate", "cuda_graph_modules": [], "cuda_graph_warmup_steps": 1}
STEPS = 4
HF_LOCATION = re.compile(r"transformers/[\w/.]+\.py:\d+$")
DECODER_LAYER = re.compile(r"(model\.layers|transformer\.h)\.\d+")
# fp32 weights under torch.compile: transformers' grouped-mm fallback reads the expert offsets on the host
# (integrations/moe.py), on a GPU as on the CPU; bf16 weights call torch._grouped_mm instead (tested below).
FALLBACK = ("host_sync", "transformers.grouped_mm_fallback", "transformers/integrations/moe.py")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trained(request):
    """family -> (plans, per-step loss diffs, parameter diff, stats) for one compiled training run."""
    import torch
    torch._dynamo.reset()
    model = build(request.param)
    compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    cgcompile.reset_stats()
    with record_plans() as rec:
        losses, params = train_like_eager(model, compiled, steps=STEPS)
    stats = cgcompile.stats()
    torch._dynamo.reset()
    return request.param, rec.graphs, losses, params, stats


def test_trains_like_eager_with_graphs_captured_and_replayed(trained):
    family, plans, losses, params, stats = trained
    assert losses == [0.0] * STEPS, family
    assert params <= 1e-6, family
    assert stats["eager_fallbacks"] == [], family
    assert stats["graphs_captured"] > 0 and stats["steady_replays"] > 0, family


def test_every_island_names_its_reason_and_hf_line(trained):
    """Dense families: no island at all. MoE families (fp32): only the grouped-mm fallback's host read, twice
    per MoE layer (forward projections), each at its HF file:line; everything else in every layer captured."""
    family, plans, *_ = trained
    islands = [reason for plan in plans for part in plan.partitions if not part.captured
               for reason in part.reasons]
    assert all(r.location and HF_LOCATION.search(r.location) for r in islands), (family, islands)
    kinds = {(r.category, r.op, r.location.rsplit(":", 1)[0].split("site-packages/")[-1]) for r in islands}
    assert kinds == ({FALLBACK} if family in MOE_FAMILIES else set()), family
    table = str(cgcompile.Plan(cgcompile.CudaGraphConfig.from_options(OPTIONS), list(plans)))
    assert " at ?" not in table and "?:" not in table, table
    layers = {m.group(0) for plan in plans for p in plan.captured if (m := DECODER_LAYER.match(p.module or ""))}
    assert len(layers) == 2, (family, layers)  # both decoder layers hold captured work


def test_bf16_default_experts_capture_each_decoder_layer_whole():
    """bf16 weights: transformers' default experts implementation is torch._grouped_mm (sort, histc, cumsum,
    no host read), so each Mixtral decoder layer is one captured partition and training matches eager."""
    import torch
    model = build("mixtral").to(torch.bfloat16)
    compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    cgcompile.reset_stats()
    with record_plans() as rec:
        losses, params = train_like_eager(model, compiled, steps=STEPS)
    stats = cgcompile.stats()
    assert losses == [0.0] * STEPS and params == 0.0
    (plan,) = rec.graphs
    assert [p.module for p in plan.partitions if p.kind == "capture"] == [
        "model", "model.layers.0", "model.layers.1", None]
    assert all(p.captured for p in plan.partitions)
    assert stats["eager_fallbacks"] == [] and stats["graphs_captured"] > 0 and stats["steady_replays"] > 0

"""dynamic_padding with real CUDA graphs: the padded expert loop trains like eager, "max" leaves no
host sync, full_iteration + "max" captures the MoE step whole; skipped without CUDA.

The same checks as tests/test_dynamic_padding.py on the emulate driver, where the buffer logic is proven; here
what only CUDA can show: nonzero_static and the padded ops capture and replay on a stream, graph memory pools.
"""

import copy

import pytest
import torch

from cgcompile import reset_stats, stats
from cgcompile.profiling import HostOpCounter
from tests.models import MODELS
from tests.padding_run import padding_options, train_like_eager

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _compiled(name, mode, **extra):
    spec = MODELS[name]
    model = spec.make().cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules", options=padding_options(mode, driver="cuda", **extra))
    return spec, model, compiled, reference


@pytest.mark.parametrize("name, mode", [("moe_mask", "max"), ("moe_mask", "buckets"), ("mixtral", "max"),
                                        ("qwen_moe", "buckets")])
def test_cuda_padded_experts_train_like_eager(name, mode):
    with torch._dynamo.config.patch(MODELS[name].dynamo_flags()):
        spec, model, compiled, reference = _compiled(name, mode)
        reset_stats()
        train_like_eager(spec, model, compiled, reference, device="cuda", scale=10.0)
    st = stats()
    assert st["steady_replays"] > 0 and st["eager_fallbacks"] == [], st["eager_fallbacks"]


def test_cuda_max_step_reads_nothing_on_the_host():
    with torch._dynamo.config.patch(MODELS["moe_mask"].dynamo_flags()):
        spec, model, compiled, _ = _compiled("moe_mask", "max")
        for seed in range(4):
            spec.loss(compiled, spec.example_inputs(seed=seed, device="cuda")[0]).backward()
            model.zero_grad(set_to_none=True)
        with HostOpCounter() as counter:
            spec.loss(compiled, spec.example_inputs(seed=9, device="cuda")[0]).backward()
    assert counter.syncs == 0


def test_cuda_full_iteration_with_max_captures_the_moe_step_whole():
    with torch._dynamo.config.patch(MODELS["moe_mask"].dynamo_flags()):
        spec, model, compiled, reference = _compiled("moe_mask", "max", cuda_graph_impl="full_iteration")
        reset_stats()
        train_like_eager(spec, model, compiled, reference, steps=4, device="cuda", scale=10.0)
    st = stats()
    assert st["graphs_captured"] == 2 and st["eager_fallbacks"] == []  # one forward graph, one backward graph

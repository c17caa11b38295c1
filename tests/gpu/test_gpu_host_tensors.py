"""tests/test_host_tensors.py with real CUDA graphs (driver "cuda"); skipped without a CUDA device. A CUDA model
called with a CPU 0-d scale that changes at every call trains like eager at every step: the ops reading the scale
run eagerly (a CUDA graph would keep the scale of its capture), and the graphs around them are replayed."""

import copy

import pytest
import torch

import cgcompile
from tests.host_cases import Scaled

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_host_scale_that_changes_every_step_trains_like_eager_around_replayed_graphs():
    torch.manual_seed(0)
    model = Scaled().cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules", options={
        "driver": "cuda", "cuda_graph_modules": [], "min_partition_ops": 1, "cuda_graph_warmup_steps": 1,
        "measure_benefit": "off"})
    cgcompile.reset_stats()
    for step in range(6):
        x, scale = torch.randn(2, 4, device="cuda"), torch.tensor(float(step + 1))  # the scale on the host
        out, expected = compiled(x, scale), reference(x, scale)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [] and st["steady_replays"] > 0, st

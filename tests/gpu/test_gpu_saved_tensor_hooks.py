"""tests/test_saved_tensor_hooks.py with real CUDA graphs and torch's own activation offloading: every saved tensor
packed into pinned host memory by `torch.autograd.graph.save_on_cpu` and unpacked onto the device in backward;
the backward graphs are captured and replay at every step, the training equal to eager's. Skipped without a CUDA
device."""

import pytest
import torch

from cgcompile import stats
from tests.test_saved_tensor_hooks import check_offloaded_training

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_save_on_cpu_offloading_replays_the_backward_graphs_on_cuda():
    steady = check_offloaded_training(1, "cuda", lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
                                      driver="cuda", measure_benefit="off")
    assert sorted(g["kind"] for g in stats()["graphs"]) == ["backward"] * 2 + ["forward"] * 2
    assert [b - a for a, b in zip(steady[-4:], steady[-3:])] == [4] * 3, steady

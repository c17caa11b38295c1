"""tests/test_threads.py with real CUDA graphs (driver "cuda"); skipped without a CUDA device: one compiled model
called from several threads at once, inference and training, every output and gradient equal to eager's, and the
graphs replay (captures with capture_error_mode="thread_local" while other threads launch work)."""

import pytest
import torch

from cgcompile import reset_stats, stats
from tests.test_threads import check_inference_threads, check_training_threads

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("scope", ["layer", "block"])
def test_inference_from_three_threads_on_cuda(scope):
    reset_stats()
    check_inference_threads("cuda", driver="cuda", measure_benefit="off", inference_cuda_graph_scope=scope)
    assert stats()["eager_fallbacks"] == []


def test_training_steps_from_two_threads_on_cuda():
    reset_stats()
    check_training_threads("cuda", driver="cuda", measure_benefit="off")
    assert stats()["eager_fallbacks"] == []

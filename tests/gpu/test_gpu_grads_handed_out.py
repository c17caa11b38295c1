"""tests/test_grads_handed_out.py with real CUDA graphs (driver "cuda"); skipped without a CUDA device: grads from
torch.autograd.grad and from a hook that stores them, kept into the next step, equal eager's at every step, and
the graphs replay."""

import pytest
import torch

from cgcompile import reset_stats, stats
from tests.test_grads_handed_out import check_kept_grads

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("how", ["autograd.grad", "hook"])
def test_grads_kept_into_the_next_step_stay_eagers_on_cuda(how):
    reset_stats()
    steady = check_kept_grads(how, "cuda", driver="cuda", measure_benefit="off")
    assert steady[-1] > steady[-4], steady
    assert stats()["eager_fallbacks"] == []

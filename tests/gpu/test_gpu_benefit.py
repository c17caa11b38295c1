"""The benefit rule on a GPU (issue #38): on the cuda driver it is on by default, CUDA events time the eager
warmup calls and the first replays, and the verdict is recorded with both times; skipped without CUDA."""

import pytest
import torch

from tests.test_decode import OPTIONS, assert_decode_matches_eager

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_decode_is_timed_by_default_and_judged_with_both_times():
    _, st = assert_decode_matches_eager(dict(OPTIONS, driver="cuda"), device="cuda", exact=False)
    (measured,) = st["benefit"].values()
    assert measured["eager_ms"] > 0 and measured["replay_ms"] > 0
    print("decode step:", measured)  # what pays on this GPU (docs/benchmarks.md)
    if not measured["profitable"]:
        assert any("not_profitable" in f["reason"] for f in st["eager_fallbacks"])


def test_cuda_event_timer_times_device_work():
    from cgcompile.runtime.drivers.timing import CudaEventTimer
    x = torch.randn(2048, 2048, device="cuda")
    out, seconds = CudaEventTimer(x.device).measure(lambda a: a @ a, x, "p", "eager inference")
    assert out.shape == x.shape and 0 < seconds < 10

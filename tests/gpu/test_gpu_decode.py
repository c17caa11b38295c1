"""KV-cache decode with real CUDA graphs: greedy tokens match eager over 16 steps; skipped without CUDA."""

import pytest
import torch

from tests.test_decode import OPTIONS, assert_decode_matches_eager, inductor_requests  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("options", [dict(OPTIONS, inner_compiler="eager"), dict(OPTIONS, inner_compiler="inductor"),
                                     {"cuda_graph_impl": "full_iteration"}], ids=["local-eager", "local-inductor",
                                                                                 "full-iteration"])
def test_cuda_decode_matches_eager(options):
    _, st = assert_decode_matches_eager(dict(options, driver="cuda"), device="cuda", exact=False)
    assert st["graphs_captured"] == 1 and st["eager_fallbacks"] == []


def test_cuda_decode_by_default_fuses_its_partitions_with_inductor(inductor_requests):  # noqa: F811 (the fixture)
    """inner_compiler auto (the default) on the cuda driver: Inductor compiles what is captured."""
    _, st = assert_decode_matches_eager(dict(OPTIONS, driver="cuda"), device="cuda", exact=False)
    assert inductor_requests and all(inductor_requests)
    assert st["graphs_captured"] == 1 and st["eager_fallbacks"] == [] and st["steady_replays"] > 0

"""tests/test_runtime_layouts.py with real CUDA graphs (driver "cuda"); skipped without a CUDA device: expanded
outputs, stride-0 / transposed / offset / empty inputs replay like eager, captured and replayed."""

import pytest
import torch

import cgcompile
from tests.layout_cases import CASES, on_device

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_any_layout_replays_like_eager_on_cuda(case):
    fn, make = CASES[case]
    compiled = torch.compile(fn, backend="cudagraph_modules", options={"driver": "cuda", "inner_compiler": "eager",
                                                                       "cuda_graph_warmup_steps": 1})
    cgcompile.reset_stats()
    with torch.no_grad():
        for step in range(4):
            host = make(step)
            args = tuple(on_device(a, "cuda") for a in host)
            assert [a.storage_offset() for a in args] == [a.storage_offset() for a in host]  # the case's layout
            got, want = compiled(*args), fn(*args)
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [] and st["graphs_captured"] >= 1 and st["steady_replays"] >= 1, st

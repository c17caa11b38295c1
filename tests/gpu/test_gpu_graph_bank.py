"""The graph bank's memory bound with real CUDA graphs (pool bytes included); skipped without a CUDA device.

The CPU twin is tests/test_graph_bank.py (emulate driver), on the same run: the tests' MoE, default options, 512
new tokens every step.
"""

from __future__ import annotations

import pytest
import torch

import cgcompile
from tests.bank_run import moe_bank_run

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_moe_with_new_sizes_every_step_holds_graph_memory_that_does_not_grow_on_cuda():
    found = moe_bank_run(40, (10, 40), device="cuda", driver="cuda")
    (held_10, _, _, allocated_10), (held_40, used_40, labels, allocated_40) = found[10], found[40]
    assert held_40 <= 1.5 * used_40
    assert abs(held_40 - held_10) <= 0.1 * held_10
    assert allocated_40 <= 1.1 * allocated_10  # what the graphs and their pools keep between steps
    assert len(labels) == len(set(labels))
    assert any(p["stopped"] for p in cgcompile.stats()["partitions"])

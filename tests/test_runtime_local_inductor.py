"""The local runtime on single partitions with the Inductor inner compiler (CPU + emulate): writes Inductor keeps
inside its graphs, and the saved tensors its backward is donated, replay like eager. The helpers are
tests/test_runtime_local.py's."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.nn as nn

from cgcompile import stats
from tests.inductor_cpp import needs_inductor_cpp
from tests.test_runtime_local import graphs_of, partition, runtime, twins


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x, acc):
        acc.add_(1)  # an input written in place (Inductor keeps such writes inside its graphs)
        return torch.tanh(self.bn(self.lin(x))) + acc


@needs_inductor_cpp
@pytest.mark.inductor
def test_inductor_inner_compiler_with_in_graph_mutations():
    ref, model = twins(Normed)
    rt = runtime(inner_compiler="inductor")
    p = partition(model, rt)
    for step in range(4):  # a new `acc` every call: read in place at the capture, copied in and back from then on
        model.zero_grad(), ref.zero_grad()
        x = torch.randn(5, 6)
        acc, acc_ref = torch.zeros(5, 6), torch.zeros(5, 6)
        p(x, acc).sum().backward()
        ref(x, acc_ref).sum().backward()
        assert torch.equal(acc, acc_ref)  # written once per call, also on the capture call
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)  # fused kernels reorder sums
        for a, b in zip(model.buffers(), ref.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            acc, acc_ref = torch.zeros(5, 6), torch.zeros(5, 6)
            torch.testing.assert_close(p(x, acc), ref(x, acc_ref), rtol=1e-4, atol=1e-5)
            assert torch.equal(acc, acc_ref)
    s = stats()
    assert s["steady_replays"] > 0 and s["eager_fallbacks"] == []


class Donating(nn.Module):
    """Inductor's backward reuses a saved activation (aot's donated buffer: fc2's output, read by sin's backward)
    as scratch, writing it in place from a C++ kernel."""

    def __init__(self, d=8):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(h * h).sin()


@needs_inductor_cpp
@pytest.mark.inductor
def test_inductor_backward_writing_its_donated_saved_tensors_is_undone_at_capture():
    """The emulated capture of the backward runs it once: its writes into the saved activations it was donated
    must be undone, or the replay that follows reads scratch (issue #36: wrong grads from the capture step on)."""
    assert functorch_config.donated_buffer  # torch's default: what this test is about
    ref, model = twins(Donating)
    rt = runtime(inner_compiler="inductor")
    p = partition(model, rt)
    for step in range(3):  # warmup, capture, replay
        model.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
        x = torch.randn(4, 8)
        p(x).sum().backward()
        ref(x).sum().backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, step=step: f"step {step}: {m}")
    assert graphs_of(p, "backward") and stats()["eager_fallbacks"] == []

"""Saved-tensor hooks around the forward (`torch.autograd.graph.saved_tensors_hooks`): activation offloading
(`save_on_cpu` on a GPU packs every saved tensor into host memory and unpacks a new device tensor in backward),
compression. The backward then gets new tensors, not the forward graph's outputs, so nothing it is handed names the
forward instance it belongs to: every backward ran eagerly, silently, while its forward replayed. It is now paired
with the one forward replay awaiting its backward, and its graph copies those tensors in. Emulated here by a hook
that packs a copy and unpacks another, as `save_on_cpu` does between devices; emulate driver."""

from __future__ import annotations

import copy

import pytest
import torch

import cgcompile
from tests.models import dense_gpt

OPTIONS = {"cuda_graph_modules": ["attn", "mlp"], "driver": "emulate", "cuda_graph_warmup_steps": 1}


def offloading():
    """What save_on_cpu does across devices: a saved tensor leaves as a copy and comes back as another."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t.clone())


def check_offloaded_training(micro_batches: int, device: str = "cpu", hooks=offloading, **options) -> list:
    """8 SGD steps of a 2-layer dense GPT on `device`, each micro-batch's forward under `hooks()`, compiled with
    OPTIONS and `options` beside eager: the parameters equal eager's after every step. Returns the steady replays
    counted after each step."""
    torch._dynamo.reset()
    cgcompile.reset_stats()
    reference = dense_gpt.build(2).to(device)
    model = copy.deepcopy(reference)
    compiled = torch.compile(model, backend="cudagraph_modules", options={**OPTIONS, **options})
    steady = []
    for step in range(8):
        for m, call in ((reference, reference), (model, compiled)):
            m.zero_grad(set_to_none=True)
            for micro in range(micro_batches):  # accumulated: forward, backward, forward, backward
                tokens = dense_gpt.example_inputs(seed=10 * step + micro, device=device)[0]
                with hooks():
                    loss = dense_gpt.lm_loss(call(tokens), tokens)
                loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.01 * p.grad)
        for p, q in zip(reference.parameters(), model.parameters()):
            if device == "cpu":
                assert torch.equal(p, q), step
            else:
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        steady.append(cgcompile.stats()["steady_replays"])
    return steady


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_backward_graphs_replay_when_hooks_replace_the_saved_tensors(micro_batches):
    steady = check_offloaded_training(micro_batches)
    graphs = cgcompile.stats()["graphs"]
    assert sorted(g["kind"] for g in graphs) == ["backward"] * 2 + ["forward"] * 2, graphs
    # each layer's forward and backward graph replays at every micro-batch of the last steps
    assert [b - a for a, b in zip(steady[-4:], steady[-3:])] == [4 * micro_batches] * 3, steady

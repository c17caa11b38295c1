"""rewrites/shared_inputs.py: a value several captured partitions of a frame read is copied into graph memory
once, by the first graph reading it, and read in place by the others; a value the frame writes in place is left to
each graph's own copy (a clone made before the write would be stale). Exact against eager, in inference and in
training (outputs and every gradient; emulate driver); the decode case and its copy count are in
tests/test_decode.py."""

import copy

import pytest
import torch
import torch.nn as nn

import cgcompile
from tests.frame_ops import FrameOps, counting_backend, replays_flagged

OPTIONS = {"cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": "layer", "driver": "emulate",
           "cuda_graph_warmup_steps": 1}


class Layer(nn.Module):
    def __init__(self, tag: str):
        super().__init__()
        self.linear = cgcompile.tag(tag)(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)))

    def forward(self, x, scale):
        return self.linear(x) + scale  # (an add saves nothing for the backward: the write below is legal)


class Model(nn.Module):
    """Three layers read `scale`, made outside every layer; `write` scales it in place after the first."""

    def __init__(self, write: bool):
        super().__init__()
        self.layers = nn.ModuleList([Layer("attn"), Layer("mlp"), Layer("attn")])
        self.write = write

    def forward(self, x, s):
        scale = s.sigmoid()  # eager: outside every tagged module
        x = self.layers[0](x, scale)
        if self.write:
            scale.mul_(2)  # written in place between the first and second layers' graphs
        for layer in self.layers[1:]:
            x = layer(x, scale)
        return x


def run(write: bool, training: bool = False, steps: int = 5):
    """Eager and compiled side by side (exact, gradients too when training), then one steady call counted: the
    ops its frame runs outside and inside the graphs (the forward: the backward runs after the frame returns)."""
    torch._dynamo.reset()
    cgcompile.reset_stats()
    torch.manual_seed(0)
    model = Model(write).train(training)
    reference = copy.deepcopy(model)
    counters = []
    compiled = torch.compile(model, backend=counting_backend(OPTIONS, counters))
    with torch.set_grad_enabled(training), replays_flagged():
        for step in range(steps + 1):
            if step == steps:
                counters.append(FrameOps())
            x, s = torch.randn(4, 8), torch.randn(4, 1)
            got, want = compiled(x, s), reference(x, s)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")
            if training:
                got.square().sum().backward()
                want.square().sum().backward()
                for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"{name}, step {step}")
                    p.grad = q.grad = None
    return counters.pop(), cgcompile.stats()


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_value_three_graphs_read_is_copied_in_once_and_the_run_is_exact(training):
    counted, st = run(write=False, training=training)
    # the first graph copies x and scale in and clones scale for the other two, which read it in place
    assert counted.ops.get("aten._foreach_copy_.default") == 1, counted.ops
    assert counted.graph_ops.get("aten.clone.default") == 1, counted.graph_ops
    assert st["eager_fallbacks"] == [] and st["steady_replays"] >= 3 * 3


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_value_written_in_place_between_the_graphs_is_not_shared(training):
    counted, st = run(write=True, training=training)
    # each graph copies scale in itself: the second and third read it after the write
    assert counted.ops.get("aten._foreach_copy_.default") == 3, counted.ops
    assert "aten.clone.default" not in counted.graph_ops, counted.graph_ops
    assert st["eager_fallbacks"] == []

"""explain() runs the model to trace it and leaves everything as it found it (cgcompile/model_state.py):
BatchNorm's running statistics, a counting buffer, a cache buffer and a cache argument written in place (one of
them by code Dynamo runs eagerly, between graphs), a buffer the forward rebinds, a plain attribute, gradients,
and the random generators that dropout and a `torch.Generator` argument draw from."""

import random

import torch

import cgcompile


class KVCache:
    """A cache object passed as an argument, holding its tensors in a list (as HF's caches do)."""

    def __init__(self):
        self.layers = [{"keys": torch.zeros(4, 8)}]


@torch._dynamo.disable
def count_eagerly(counter: torch.Tensor) -> None:
    counter.add_(10)  # runs between graphs: a graph break


class Stateful(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.drop = torch.nn.Dropout(0.5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("cache", torch.zeros(4, 8))
        self.register_buffer("last", torch.zeros(8))
        self.steps = 0

    def forward(self, x, pos, kv, generator):
        self.calls.add_(1)
        h = self.drop(self.norm(self.proj(x)))
        self.cache.index_copy_(0, pos, h[:1].detach())
        kv.layers[0]["keys"].index_copy_(0, pos, h[:1].detach() * 2)
        count_eagerly(self.calls)
        self.last = h[0].detach().clone()  # rebinds the buffer
        self.steps += 1
        return h + torch.rand(8, generator=generator) + self.cache.sum()


def test_explain_leaves_the_model_its_arguments_and_every_generator_as_it_found_them():
    torch.manual_seed(0)
    model = Stateful()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    x, pos, kv, generator = torch.randn(6, 8), torch.tensor([2]), KVCache(), torch.Generator().manual_seed(7)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = dict(model.named_buffers())
    grads = {name: (p.grad, p.grad.clone()) for name, p in model.named_parameters()}
    keys, kv_values = kv.layers[0]["keys"], kv.layers[0]["keys"].clone()
    cpu_rng, user_rng, python_rng = torch.get_rng_state(), generator.get_state(), random.getstate()

    plan = cgcompile.explain(model, x, pos, kv, generator, options={"driver": "emulate"})

    assert plan.graphs and plan.graph_breaks, plan  # it traced the model (and broke at count_eagerly)
    after = model.state_dict()
    assert after.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(after[name], value), name
    assert all(model.get_buffer(name) is b for name, b in buffers.items())  # `last` bound to its tensor again
    for name, p in model.named_parameters():
        assert p.grad is grads[name][0] and torch.equal(p.grad, grads[name][1]), name
    assert kv.layers[0]["keys"] is keys and torch.equal(keys, kv_values)
    assert model.steps == 0 and model.training
    assert torch.equal(torch.get_rng_state(), cpu_rng) and torch.equal(generator.get_state(), user_rng)
    assert random.getstate() == python_rng


def test_the_run_explain_makes_would_change_the_model():
    """The premise: the same call compiled for real changes each of those (so the test above can fail)."""
    torch.manual_seed(0)
    model = Stateful()
    kv, generator = KVCache(), torch.Generator().manual_seed(7)
    cpu_rng, user_rng = torch.get_rng_state(), generator.get_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.compile(model, backend="eager")(torch.randn(6, 8), torch.tensor([2]), kv, generator)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"calls", "cache", "last", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    assert kv.layers[0]["keys"].abs().sum() > 0 and model.steps == 1
    assert not torch.equal(torch.get_rng_state(), cpu_rng) and not torch.equal(generator.get_state(), user_rng)

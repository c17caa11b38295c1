"""The training traps of CUDA-graph capture, end to end through the real backend, on CPU with the emulate driver.

Every model here is compiled with `torch.compile(model, backend="cudagraph_modules", options={..., "driver":
"emulate"})`: the backend plans the partitions, splits the Dynamo graph and hands each captured partition to the
runtime (ModelRuntime + compile_partition). The small models get the partitioning each trap needs from real
options: "whole layer" mode (`cuda_graph_modules: []`, cut at numbered layers) with `min_partition_ops: 1`, or
module tags on the model's submodules. Emulate keeps static buffers and output objects exactly like CUDA graphs, so
every buffer mistake shows up here as a wrong number. Counters prove that graphs were captured and replayed. The
same traps on the tiny zoo models: test_runtime_traps_zoo.py; captures that cannot be used (a moved parameter, the
bank's cap, a failed capture): test_runtime_fallbacks.py.
"""

from __future__ import annotations

import logging
import math
from typing import List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgcompile
from cgcompile import backend as backend_mod
from cgcompile import reset_stats, stats
from cgcompile.backend import record_plans
from cgcompile.runtime.drivers import base as driver_mod

D = 8

# Whole-layer mode (every capture-safe span, cut at numbered layers), one-op partitions allowed, capture at the
# second call: the small models below split into the same partitions a per-module split would give them.
BASE_OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": [], "driver": "emulate",
                "cuda_graph_warmup_steps": 1, "min_partition_ops": 1,
                "inner_compiler": "eager"}  # the default auto's choice off CUDA: the GPU twins run it too


def compiled(model, **options):
    """`model` through the real backend with BASE_OPTIONS, updated by `options`."""
    return torch.compile(model, backend="cudagraph_modules", options={**BASE_OPTIONS, **options})


@pytest.fixture
def runtimes(monkeypatch) -> List:
    """The ModelRuntime of every frame the backend compiles during the test."""
    found = []
    real = backend_mod.compile_frame

    def recording(*args, **kwargs):
        run = real(*args, **kwargs)
        runtime = getattr(run, "runtime", None)
        if runtime is not None:
            found.append(runtime)
        return run

    monkeypatch.setattr(backend_mod, "compile_frame", recording)
    return found


# --- models --------------------------------------------------------------------------------------------------


class Attn(nn.Module):
    def __init__(self, d: int, p: float):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        return self.drop(self.proj(w @ v))


class Block(nn.Module):
    def __init__(self, d: int = D, p: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = Attn(d, p)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    """Whole-layer mode gives four partitions: embed, blocks.0, blocks.1, head."""

    def __init__(self, p: float = 0.0, layers: int = 2):
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(Block(D, p) for _ in range(layers))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def twins(cls=Net, seed=0, **kwargs):
    torch.manual_seed(seed)
    a = cls(**kwargs)
    b = cls(**kwargs)
    b.load_state_dict(a.state_dict())
    return a, b


def batch(seed, shape=(2, 5, 4)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g), torch.randn(shape[0], shape[1], 1, generator=g)


def assert_close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def grads(model):
    return [p.grad for p in model.parameters()]


def is_static(runtimes, t):
    """Does t live in memory a captured graph of one of these runtimes owns?"""
    return any(rt.memory.owns(t) for rt in runtimes)


def assert_captured():
    s = stats()
    assert s["graphs_captured"] > 0 and s["steady_replays"] > 0, s
    return s


def partition_name(plan, partition) -> str:
    """The name the backend gives a captured partition (stats, warnings)."""
    return plan.runner_name(partition)


# --- traps ---------------------------------------------------------------------------------------------------


def test_training_steps_match_eager_sgd(runtimes):
    ref, model = twins()
    cmodel = compiled(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        x, y = batch(step)
        for m, o, fn in ((ref, opt_ref, ref), (model, opt, cmodel)):
            o.zero_grad()
            loss = F.mse_loss(fn(x), y)
            loss.backward()
            o.step()
            m.last_loss = loss.detach()
        assert_close(model.last_loss, ref.last_loss)
        if step == 1:  # warmup step 0, capture step 1: from here on only replays
            captured = stats()["graphs_captured"]
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_close(a, b)
    s = assert_captured()
    assert s["eager_fallbacks"] == [] and s["recaptures"] == []
    assert s["graphs_captured"] == captured == 8  # 4 partitions x (forward + backward), each captured once
    assert runtimes
    assert any(rt.live_graphs() for rt in runtimes)
    # the loop clears its grads (zero_grad sets them to None): AccumulateGrad keeps the backward graphs' outputs
    # as .grad instead of cloning them, with no extra instance (8 graphs above)
    assert all(is_static(runtimes, p.grad) for p in model.parameters())


def test_training_steps_match_eager_adam_with_grad_accumulation_across_steps():
    """Adam, and grads accumulated (no zero_grad) across two backward passes per step."""
    ref, model = twins()
    cmodel = compiled(model)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(4):
        for m, o, fn in ((ref, opt_ref, ref), (model, opt, cmodel)):
            o.zero_grad(set_to_none=True)
            for micro in range(2):
                x, y = batch(10 * step + micro)
                F.mse_loss(fn(x), y).backward()
            o.step()
        for a, b in zip(model.parameters(), ref.parameters()):
            assert_close(a, b)
    assert_captured()


def test_gradient_accumulation_fwd_fwd_bwd_bwd():
    """The second forward must not overwrite activations the first backward still needs."""
    ref, model = twins()
    cmodel = compiled(model)
    for step in range(3):
        for m, fn in ((ref, ref), (model, cmodel)):
            m.zero_grad()
            x1, y1 = batch(2 * step)
            x2, y2 = batch(2 * step + 1)
            loss1 = F.mse_loss(fn(x1), y1)
            loss2 = F.mse_loss(fn(x2), y2)
            loss1.backward()
            loss2.backward()
        for a, b in zip(grads(model), grads(ref)):
            assert_close(a, b)
        if step == 1:
            captured = stats()["graphs_captured"]
    s = assert_captured()
    assert s["eager_fallbacks"] == []
    assert s["graphs_captured"] == captured  # two instances per partition, then only replays


def test_output_kept_from_step_k_is_unchanged_after_step_k_plus_1():
    for clone in (True, False):
        ref, model = twins()
        cmodel = compiled(model, clone_outputs=clone)
        kept = []
        for step in range(4):
            x, _ = batch(step)
            out = cmodel(x)
            out.sum().backward()  # nothing pending on the graph: what holds it is the output kept below
            kept.append((out.detach(), ref(x)))
        for out, expected in kept:
            assert_close(out, expected)
        assert_captured()
        reset_stats()


class Mutating(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, acc):
        x.mul_(2)  # mutates graph inputs: the plan keeps these ops eager (input_mutation)
        acc.add_(self.lin(x))
        return self.lin(x).relu() + acc


class ScaleInPlace(nn.Linear):
    def forward(self, x):
        x.mul_(2)  # mutates its partition's input: the previous partition's (static) output
        return super().forward(x)


class MutatingInner(nn.Module):
    """Whole-layer mode: layers.0 | layers.1 (mutates its input in place) | the residual add, reading it after."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), ScaleInPlace(4, 4)])

    def forward(self, x):
        h = self.layers[0](x)
        return self.layers[1](h).relu() + h


def test_in_place_mutation_of_an_input():
    """Mutated graph inputs stay eager (the plan says why) while the partitions reading them are captured; a
    captured partition that mutates its own input (another partition's output) copies the result back."""
    ref, model = twins(Mutating)
    cmodel = compiled(model)
    with record_plans() as rec:
        for step in range(4):
            x, _ = batch(step, (3, 4))
            acc = torch.ones(3, 4)
            x2, acc2 = x.clone(), acc.clone()
            model.zero_grad(), ref.zero_grad()
            out = cmodel(x, acc)
            expected = ref(x2, acc2)
            assert_close(out, expected)
            assert_close(x, x2)
            assert_close(acc, acc2)
            out.sum().backward()
            expected.sum().backward()
            for a, b in zip(grads(model), grads(ref)):
                assert_close(a, b)
    (plan,) = rec.graphs
    eager_reasons = {r.category for p in plan.partitions if not p.captured for r in p.reasons}
    assert eager_reasons == {"input_mutation"} and len(plan.captured) == 2
    assert_captured()

    reset_stats()
    ref, model = twins(MutatingInner)
    cmodel = compiled(model)
    with record_plans() as rec:
        for step in range(4):
            x, _ = batch(step, (3, 4))
            model.zero_grad(), ref.zero_grad()
            out, expected = cmodel(x), ref(x)
            assert_close(out, expected)
            out.sum().backward()
            expected.sum().backward()
            for a, b in zip(grads(model), grads(ref)):
                assert_close(a, b)
    (plan,) = rec.graphs
    assert len(plan.partitions) == len(plan.captured) == 3
    s = assert_captured()
    assert s["eager_fallbacks"] == []


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def test_batchnorm_buffers_update_once_per_step():
    """Buffers mutated in place by the graph (running stats) are static inputs, updated exactly once."""
    ref, model = twins(Normed)
    cmodel = compiled(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, y = batch(step, (8, 4))
        y = y[:, :1, 0]
        for o, fn in ((opt_ref, ref), (opt, cmodel)):
            o.zero_grad()
            F.mse_loss(fn(x), y).backward()
            o.step()
        for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
            assert_close(a, b)
    model.eval(), ref.eval()
    assert_close(cmodel(batch(9, (8, 4))[0]), ref(batch(9, (8, 4))[0]))
    assert_captured()


def test_dropout_fresh_masks_and_grads_consistent_with_them():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(256))
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x * self.scale)

    model = Drop()
    cmodel = compiled(model)
    x = torch.randn(4, 256)
    masks = []
    for step in range(4):
        model.zero_grad()
        out = cmodel(x)
        out.sum().backward()
        mask = out != 0
        masks.append(mask)
        # y = x * s * m / (1 - p): dy/ds = sum over rows of x * m * 2
        assert_close(model.scale.grad, (x * mask * 2).sum(0))
        assert 0.3 < mask.float().mean() < 0.7
        if step == 1:
            captured = stats()["graphs_captured"]
    assert not torch.equal(masks[1], masks[2]) and not torch.equal(masks[2], masks[3])
    s = assert_captured()
    assert s["graphs_captured"] == captured  # steps 2 and 3 replayed: fresh masks come from replays


def test_train_eval_switch():
    ref, model = twins(p=0.3)
    cmodel = compiled(model)
    for step in range(3):
        model.train(), ref.train()
        x, y = batch(step)
        F.mse_loss(cmodel(x), y).backward()
        model.eval(), ref.eval()
        x, _ = batch(100 + step)
        with torch.no_grad():
            assert_close(cmodel(x), ref(x))
        assert_close(cmodel(x), ref(x))  # eval with grad enabled
    assert_captured()


def test_no_grad_inference():
    ref, model = twins()
    cmodel = compiled(model)
    with torch.no_grad():
        outs = [(cmodel(batch(s)[0]), ref(batch(s)[0])) for s in range(4)]
    for out, expected in outs:
        assert_close(out, expected)
        assert not out.requires_grad
    assert_captured()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.inp(x))))


TIED_TAGS = {"inp": "tied_in", "mid": "middle", "out": "tied_out"}


def tag_tied(model: Tied) -> Tied:
    """One tag per linear layer: inp | mid | tanh (untagged glue, eager) | out, the tied weight in two graphs."""
    return cgcompile.tag_modules(model, TIED_TAGS)


def test_weight_tying_across_partitions():
    ref, model = twins(Tied)
    cmodel = compiled(tag_tied(model), cuda_graph_modules=list(TIED_TAGS.values()))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record_plans() as rec:
        for step in range(4):
            x, _ = batch(step, (3, 4))
            for o, fn in ((opt_ref, ref), (opt, cmodel)):
                o.zero_grad()
                fn(x).pow(2).sum().backward()
                o.step()
            for a, b in zip(model.parameters(), ref.parameters()):
                assert_close(a, b)
    (plan,) = rec.graphs
    assert [p.module for p in plan.captured] == ["inp", "mid", "out"]
    assert_captured()


def _define_host_sync_op():
    """cgtest::host_sync: reads a device value on the host inside its kernel, where no graph pass can see it.
    On CPU it raises like CUDA does when a driver is capturing. Idempotent (the GPU tests import this file)."""
    if hasattr(torch.ops.cgtest, "host_sync"):
        return
    torch.library.define("cgtest::host_sync", "(Tensor x) -> Tensor")

    @torch.library.impl("cgtest::host_sync", "CompositeExplicitAutograd")
    def _host_sync(x):
        if x.device.type == "cpu" and driver_mod.is_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return x * float(x.sum().item() > -1e30)

    @torch.library.register_fake("cgtest::host_sync")
    def _host_sync_fake(x):
        return torch.empty_like(x)

    torch.library.register_autograd("cgtest::host_sync", lambda ctx, grad: grad)  # straight-through


_define_host_sync_op()


class SyncingLinear(nn.Linear):
    def forward(self, x):
        return torch.ops.cgtest.host_sync(super().forward(x))


class Syncing(nn.Module):
    """`a` ends in cgtest::host_sync; tag_syncing puts a and b in partitions of their own."""

    def __init__(self):
        super().__init__()
        self.a = SyncingLinear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


SYNCING_TAGS = {"a": "syncing", "b": "plain"}


def tag_syncing(model: Syncing) -> Syncing:
    return cgcompile.tag_modules(model, SYNCING_TAGS)


def test_unclassified_sync_op_falls_back_and_training_continues(caplog):
    ref, model = twins(Syncing)
    cmodel = compiled(tag_syncing(model), cuda_graph_modules=list(SYNCING_TAGS.values()))
    with caplog.at_level(logging.WARNING, logger="cgcompile"), record_plans() as rec:
        for step in range(3):
            x, _ = batch(step, (3, 4))
            assert_close(cmodel(x), ref(x))
    (plan,) = rec.graphs
    syncing = plan.partitions[0]
    assert [p.module for p in plan.captured] == ["a", "b"] and syncing.module == "a"
    s = stats()
    assert [f["partition"] for f in s["eager_fallbacks"]] == [partition_name(plan, syncing)]
    assert "not permitted when stream is capturing" in s["eager_fallbacks"][0]["reason"]
    assert s["graphs_captured"] > 0 and s["steady_replays"] > 0  # the other partition still captures
    assert sum("not permitted" in r.getMessage() for r in caplog.records) == 1

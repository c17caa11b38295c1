"""The training traps of CUDA-graph capture, end to end through Dynamo, on CPU with the emulate driver.

A tiny Dynamo backend (below, test-only) splits each graph by module path with split_module and wraps
every partition with the public runtime API (ModelRuntime + compile_partition); the project's real
backend replaces it. Emulate keeps static buffers and output objects exactly like CUDA graphs, so every
buffer mistake shows up here as a wrong number. Counters prove that graphs were captured and replayed.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, List

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.split_module import split_module

from cgcompile.stats import reset_stats, stats
from cgcompile.config import CudaGraphConfig
from cgcompile.runtime import ModelRuntime, compile_partition
from cgcompile.runtime import driver as driver_mod
from tests.models import dense_gpt, moe

D = 8


# --- a test-only backend -------------------------------------------------------------------------------------


def _module_key(node: fx.Node, depth: int):
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    return ".".join(path.split(".")[:depth]) or None


def runtime_backend(options: dict, *, depth: int = 2, eager: str = None, runtimes: List = None):
    """A Dynamo backend: one partition per module path (`depth` components), untagged glue joins the
    previous run; partitions whose path fully matches the regex `eager` run as plain FX code."""
    config = CudaGraphConfig.from_options(options)

    def backend(gm: fx.GraphModule, example_inputs: List[Any]):
        devices = [t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
        runtime = ModelRuntime(config, devices[0] if devices else "cpu")
        if runtimes is not None:
            runtimes.append(runtime)
        owner, eager_runs, run, prev = {}, set(), -1, object()
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            key = _module_key(node, depth) or (prev if run >= 0 else "")
            if key != prev:
                run, prev = run + 1, key
            owner[node.name] = run
            if eager and re.fullmatch(eager, key):
                eager_runs.add(run)
        split = split_module(gm, None, lambda n: owner.get(n.name, 0), keep_original_order=True)
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        static = {name for name, t in zip(placeholders, example_inputs)
                  if isinstance(t, nn.Parameter) or hasattr(t, "_dynamo_static_input_type")}
        for node in list(split.graph.nodes):
            if node.op != "call_module" or int(node.target.split("_")[-1]) in eager_runs:
                continue
            sub = getattr(split, node.target)
            indices = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.name in static]
            examples = [n.meta.get("example_value") for n in sub.graph.nodes if n.op == "placeholder"]
            wrapped = compile_partition(sub, examples, name=node.target, static_input_indices=indices,
                                        runtime=runtime, location=f"test:{node.target}")
            delattr(split, node.target)
            setattr(split, node.target, wrapped)

        def run_frame(*args):
            return runtime.finish_frame_outputs(split(*args))

        return run_frame

    return backend


def compiled(model, depth=2, eager=None, runtimes=None, **options):
    opts = {"driver": "emulate", "cuda_graph_warmup_steps": 1}
    opts.update(options)
    return torch.compile(model, backend=runtime_backend(opts, depth=depth, eager=eager, runtimes=runtimes))


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


def static_ptrs(runtimes):
    return {ptr for rt in runtimes for ptr in rt._owners}


@pytest.fixture(autouse=True)
def _clean_stats():
    reset_stats()
    yield


def assert_captured():
    s = stats()
    assert s["graphs_captured"] > 0 and s["replays"] > 0, s
    return s


# --- traps ---------------------------------------------------------------------------------------------------


def test_training_steps_match_eager_sgd():
    ref, model = twins()
    runtimes = []
    cmodel = compiled(model, runtimes=runtimes)
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
    owned = static_ptrs(runtimes)
    assert all(p.grad.untyped_storage().data_ptr() not in owned for p in model.parameters())


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
            kept.append((out, ref(x)))
        for out, expected in kept:
            assert_close(out, expected)
        assert_captured()
        reset_stats()


def test_in_place_mutation_of_an_input():
    class Mutating(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, acc):
            x.mul_(2)  # mutates graph inputs: aot copies the new values back
            acc.add_(self.lin(x))
            return self.lin(x).relu() + acc

    ref, model = twins(Mutating)
    cmodel = compiled(model, depth=1)
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
    assert_captured()


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
    cmodel = compiled(model, depth=1)
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
    cmodel = compiled(model, depth=1)
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


def test_weight_tying_across_partitions():
    ref, model = twins(Tied)
    cmodel = compiled(model, depth=1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, _ = batch(step, (3, 4))
        for o, fn in ((opt_ref, ref), (opt, cmodel)):
            o.zero_grad()
            fn(x).pow(2).sum().backward()
            o.step()
        for a, b in zip(model.parameters(), ref.parameters()):
            assert_close(a, b)
    assert_captured()


def test_param_address_change_recaptures():
    ref, model = twins()
    cmodel = compiled(model)
    for step in range(4):
        x, _ = batch(step)
        assert_close(cmodel(x), ref(x))
    with torch.no_grad():
        for m in (model, ref):
            m.head.weight.mul_(2)
    model.head.weight.data = model.head.weight.data.clone()  # same values, new address
    x, _ = batch(9)
    assert_close(cmodel(x), ref(x))
    s = stats()
    assert len(s["recaptures"]) == 1 and "moved" in s["recaptures"][0]["reason"]


def test_graph_bank_cap_falls_back_to_eager(caplog):
    ref, model = twins()
    cmodel = compiled(model, max_graphs_per_partition=1, clone_outputs=False)
    kept = []
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for step in range(4):
            x, _ = batch(step)
            kept.append((cmodel(x), ref(x)))  # held outputs keep instance 0 busy
    for out, expected in kept:
        assert_close(out, expected)
    s = stats()
    assert s["eager_fallbacks"] and all("max_graphs_per_partition=1" in f["reason"] for f in s["eager_fallbacks"])
    cap_warnings = [r for r in caplog.records if "max_graphs_per_partition" in r.getMessage()]
    assert len(cap_warnings) == len({f["partition"] for f in s["eager_fallbacks"]})


class _FailingDriver(driver_mod.EmulateDriver):
    def capture(self, fn, static_inputs, pool=None):
        raise driver_mod.CaptureError("injected failure")


def test_injected_capture_failure_falls_back(caplog, monkeypatch):
    ref, model = twins()
    monkeypatch.setattr(driver_mod, "EmulateDriver", _FailingDriver)
    cmodel = compiled(model)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for step in range(4):
            model.zero_grad(), ref.zero_grad()
            x, y = batch(step)
            F.mse_loss(cmodel(x), y).backward()
            F.mse_loss(ref(x), y).backward()
            for a, b in zip(grads(model), grads(ref)):
                assert_close(a, b)
    s = stats()
    assert s["graphs_captured"] == 0
    names = [f["partition"] for f in s["eager_fallbacks"]]
    assert names and len(names) == len(set(names))
    warnings = [r for r in caplog.records if "injected failure" in r.getMessage()]
    assert len(warnings) == len(names)
    assert all("test:" in r.getMessage() for r in warnings)  # names the location


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


class Syncing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.ops.cgtest.host_sync(self.a(x)))


def test_unclassified_sync_op_falls_back_and_training_continues(caplog):
    ref, model = twins(Syncing)
    cmodel = compiled(model, depth=1)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for step in range(3):
            x, _ = batch(step, (3, 4))
            assert_close(cmodel(x), ref(x))
    s = stats()
    assert [f["partition"] for f in s["eager_fallbacks"]] == ["submod_0"]
    assert "not permitted when stream is capturing" in s["eager_fallbacks"][0]["reason"]
    assert s["graphs_captured"] > 0 and s["replays"] > 0  # the other partition still captures
    assert sum("not permitted" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("zoo, eager", [(moe, r"layers\.\d+\.moe(\.experts.*)?"), (dense_gpt, None)],
                         ids=["moe", "dense"])
def test_tiny_models_train_like_eager(zoo, eager):
    """The MoE's data-dependent dispatch (nonzero, gather, index_add_) stays eager; attention, router and
    preprocess are captured. Dynamo reuses one frame per layer there (graph breaks), so partitions serve
    several parameter sets."""
    model = zoo.build()
    ref = zoo.build()
    cmodel = compiled(model, depth=4, eager=eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # (Adam would amplify sum-order differences in tiny grads)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        for m, o, fn in ((model, opt, cmodel), (ref, opt_ref, ref)):
            losses = [zoo.loss(fn, zoo.example_inputs(seed=2 * step + i)[0]) for i in range(2)]
            for loss in losses:  # fwd, fwd, bwd, bwd
                loss.backward()
            o.step()
            o.zero_grad()
            m.last = losses[0].detach()
        assert_close(model.last, ref.last)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_close(a, b)
    with torch.no_grad():
        tokens = zoo.example_inputs(seed=99)[0]
        for _ in range(3):
            assert_close(cmodel(tokens), ref(tokens))
    s = assert_captured()
    assert s["eager_fallbacks"] == [] and s["recaptures"] == []

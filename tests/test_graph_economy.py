"""No graph held that is not used (issue 40): a gradient kept into the next step, arena members under no_grad, and
the graph-bank counters in every path."""

from __future__ import annotations

import copy
import gc
import random

import pytest
import torch
import torch.nn as nn

import cgcompile
from tests.test_arena import batch, compiled, mlp

OPTIONS = {"driver": "emulate", "cuda_graph_warmup_steps": 1, "cuda_graph_modules": []}


def three_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))


@pytest.mark.parametrize("kept", ["last grad", "every grad"])
def test_a_gradient_kept_into_the_next_step_adds_no_instance_and_stays_exact(kept):
    """`g = p.grad` in a logging loop keeps a grad the backward graph handed out as .grad into the next step's
    forward: answered by that backward graph copying its grads from then on, not by another instance every few
    steps (../shared/repros/grad_kept.py held 8 graphs for 2)."""
    model = three_linears()
    reference = copy.deepcopy(model)
    cgcompile.reset_stats()
    torch._dynamo.reset()
    gc.collect()  # runtimes of earlier tests (reference cycles) leave stats()['graphs'] now, not at a later GC
    run = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, reference)]
    kept_grads = []
    for step in range(24):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        for m, fn, opt in ((model, run, opts[0]), (reference, reference, opts[1])):
            opt.zero_grad(set_to_none=True)
            fn(x).square().mean().backward()
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
        kept_grads = [p.grad for p in model.parameters()][-1:] if kept == "last grad" else [
            p.grad for p in model.parameters()]  # alive into the next step
        for opt in opts:
            opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for grad, p in zip(kept_grads[::-1], list(model.parameters())[::-1]):
        assert grad is p.grad  # the loop's own references, untouched
    graphs = cgcompile.stats()["graphs"]
    assert len(graphs) == cgcompile.stats()["graphs_captured"] == 2  # forward and backward, nothing more
    assert all(g["steady_replays"] >= 20 for g in graphs)  # both replayed on (almost) every step after capture


def test_an_arena_member_free_of_its_own_is_released_while_the_arena_is_in_use():
    """Under no_grad with rows that change: the graph of a size no longer seen is swept on its own claim, though the
    arena it shares is held by the current call's output (the pool rule still holds: outputs stay exact)."""
    model = mlp().eval()
    run = compiled(model)
    with torch.no_grad():
        for i in range(3):
            torch.testing.assert_close(run(batch(6, i)), model(batch(6, i)), rtol=0, atol=0)
        outputs = []
        for i in range(60):
            x = batch(4, 100 + i)
            out = run(x)
            outputs.append((out, model(x)))  # every output kept: the arena stays in use
            outputs = outputs[-2:]
            for got, want in outputs:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    live = [g for g in cgcompile.stats()["graphs"] if g["arena"]]
    assert [g["label"].split("[")[1].split("]")[0] for g in live] == ["4x8"]  # the rows-6 graph was released
    assert cgcompile.stats()["partitions"][0]["releases"] >= 1


def test_the_bank_counters_add_up_on_random_call_sequences_with_failures():
    """calls = replays + misses, warmup calls and captures among the misses, after every call of random sequences of
    sizes, grad modes, moved parameters (re-captures, storms), failed captures and release()."""
    from cgcompile.runtime.drivers.base import CaptureError
    from cgcompile.runtime.drivers.emulate import EmulateDriver
    from tests.test_runtime_local import partition, runtime

    real_capture = EmulateDriver.capture
    for seed in range(6):
        rng = random.Random(seed)
        fail_at = {rng.randrange(2, 40)} if seed % 2 else set()
        captures = [0]

        def capture(self, *args, **kwargs):
            captures[0] += 1
            if captures[0] in fail_at:
                raise CaptureError("injected")
            return real_capture(self, *args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(EmulateDriver, "capture", capture)
            rt = runtime()
            w = torch.nn.Parameter(torch.randn(4))
            p = partition(lambda x, w: (x * w).tanh(), rt, static=[1])
            for _ in range(60):
                action = rng.random()
                if action < 0.05:
                    cgcompile.release()
                elif action < 0.15:
                    w.data = torch.randn(4)  # a moved parameter: a re-capture (a storm when it repeats)
                x = torch.randn(rng.choice([2, 3]), 4)
                with torch.set_grad_enabled(rng.random() < 0.5):
                    torch.testing.assert_close(p(x, w), (x * w).tanh(), rtol=0, atol=0)
                row = p.bank_counters()
                assert row.calls == row.replays + row.misses, (seed, row)
                assert row.warmup_calls + row.captures + row.recaptures <= row.misses + row.recaptures, (seed, row)


def _replays_by_graph() -> dict:
    return {g["label"]: g["replays"] for g in cgcompile.stats()["graphs"]}


@pytest.mark.parametrize("name", ["dense_gpt", "mixtral"])
def test_over_a_long_run_every_live_graph_is_replayed_within_the_policy_window(name):
    """56 training steps of a model of tests/models: every graph alive at the end ran within the last
    RELEASE_WINDOW steps (a graph the loop no longer uses is released, not kept), and the run stays exact."""
    from cgcompile.runtime.bank.policy import RELEASE_WINDOW
    from tests.models import MODELS

    spec = MODELS[name]
    torch._dynamo.reset()
    gc.collect()  # runtimes of earlier tests (reference cycles) leave stats()['graphs'] now, not at a later GC
    cgcompile.release()  # and the graphs of models still alive
    cgcompile.reset_stats()
    model = spec.make()
    reference = copy.deepcopy(model)
    with torch._dynamo.config.patch(**spec.dynamo_flags()):
        run = torch.compile(model, backend="cudagraph_modules",
                            options=spec.options(driver="emulate", cuda_graph_warmup_steps=1))
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
        marks = []
        for step in range(56):
            (tokens,) = spec.example_inputs(seed=step)
            for m, fn, opt in ((model, run, opts[0]), (reference, reference, opts[1])):
                opt.zero_grad(set_to_none=True)
                spec.loss(fn, tokens).backward()
                opt.step()
            marks.append(_replays_by_graph())
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    then, now = marks[-1 - RELEASE_WINDOW], marks[-1]
    assert now and all(now[label] > then.get(label, 0) for label in now), (then, now)


def test_graph_memory_by_kind_adds_up_and_names_saved_activations_and_gradients():
    """stats()["graph_memory"]: the kinds add up to graph_bytes; the forward outputs the backward reads are
    counted as saved for backward, the backward graphs' outputs as gradients (here stolen: they are .grad)."""
    model = three_linears()
    cgcompile.reset_stats()
    torch._dynamo.reset()
    run = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        run(torch.randn(4, 32)).square().mean().backward()
        opt.step()
    st = cgcompile.stats()
    memory = st["graph_memory"]
    assert memory["total"] == st["graph_bytes"] == sum(v for k, v in memory.items() if k != "total")
    assert memory["gradients"] == sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    assert 0 < memory["saved_for_backward"] and memory["arenas"] == memory["pool"] == 0
    (forward,) = [g for g in st["graphs"] if g["kind"] == "forward"]
    assert memory["saved_for_backward"] == forward["saved_output_bytes"] <= forward["static_output_bytes"]

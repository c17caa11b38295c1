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
from tests import graph_window
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


def test_grads_kept_in_a_model_whose_partitions_read_each_other_add_no_instance():
    """dense_gpt keeping every grad into the next step: its second partition reads the first one's output where
    it lies. The step a lesson runs the first one eagerly, the second one runs eagerly too, instead of capturing an
    instance for that eager output's address (4 graphs; before, 8 were captured, 6 still alive 30 steps on)."""
    from tests.models import MODELS

    spec = MODELS["dense_gpt"]
    graph_window.fresh()
    model = spec.make()
    reference = copy.deepcopy(model)
    run = torch.compile(model, backend="cudagraph_modules", options=spec.options(driver="emulate",
                                                                                 cuda_graph_warmup_steps=1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    kept, kept_want = [], []
    for step in range(12):
        (tokens,) = spec.example_inputs(seed=step)
        for fn, opt in ((run, opts[0]), (reference, opts[1])):
            opt.zero_grad(set_to_none=True)
            spec.loss(fn, tokens).backward()
        for got, want in zip(kept, kept_want):  # the grads kept at the step before, after this step's replays
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        kept, kept_want = [p.grad for p in model.parameters()], [p.grad.clone() for p in reference.parameters()]
        for got, want in zip(kept, kept_want):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for opt in opts:
            opt.step()
    graphs = cgcompile.stats()["graphs"]
    assert len(graphs) == cgcompile.stats()["graphs_captured"] == 4, [g["label"] for g in graphs]
    assert all(g["replays"] >= 12 - 4 for g in graphs), graphs  # all but warmup, capture and a step per lesson


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


@pytest.mark.parametrize("name", ["dense_gpt", "mixtral"])
def test_over_a_long_run_every_live_graph_is_replayed_within_the_policy_window(name):
    """56 training steps of a model of tests/models: every graph alive at the end ran within the last
    RELEASE_WINDOW steps (a graph the loop no longer uses is released, not kept), and the run stays exact."""
    from tests.models import MODELS

    spec = MODELS[name]
    graph_window.fresh()  # earlier tests' graphs leave stats()['graphs'] now, not at a later GC
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
            marks.append(graph_window.replays_by_graph())
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert marks[-1] and graph_window.unused_graphs(marks) == [], marks[-1]


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


@pytest.mark.parametrize("scope", ["layer", "block"])
def test_over_a_long_decode_run_every_live_graph_is_replayed_within_the_policy_window(scope):
    """60 greedy decode steps of tests/models/kv_gpt.py (3 prompts of 20 steps each, every prompt prefilled
    eagerly into the same static KV cache), per-partition or whole-step graphs: every graph alive at the end ran
    within the last RELEASE_WINDOW steps, every graph captured is still alive, and the tokens are eager's."""
    from tests.models import kv_gpt

    graph_window.fresh()
    model = kv_gpt.build().eval()
    reference = copy.deepcopy(model)
    options = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"], "driver": "emulate",
               "cuda_graph_warmup_steps": 1, "inference_cuda_graph_scope": scope}
    step = torch.compile(kv_gpt.DecodeStep(model), backend="cudagraph_modules", options=options)
    pos = kv_gpt.positions(model.max_seq)
    marks = []
    with torch.no_grad():
        for request in range(3):
            (prompt,) = kv_gpt.example_inputs(batch=kv_gpt.MAX_BATCH, seq=8, seed=request)
            token, tokens = kv_gpt.prefill(model, prompt), []
            for i in range(20):
                token = step(token, pos[8 + i])
                tokens.append(token)
                marks.append(graph_window.replays_by_graph())
            want = kv_gpt.generate(kv_gpt.DecodeStep(reference), reference, prompt, 20)
            assert torch.equal(torch.cat([want[:, :1]] + tokens, dim=1), want), request
    st = cgcompile.stats()
    assert marks[-1] and graph_window.unused_graphs(marks) == [], marks[-1]
    assert len(st["graphs"]) == st["graphs_captured"] and st["eager_fallbacks"] == [], st["graphs"]
    assert all(g["replays"] >= 60 - 2 for g in st["graphs"]), st["graphs"]  # all but the warmup and capture steps


def test_stats_lists_the_partitions_in_the_order_their_frames_were_compiled():
    """stats()["partitions"] and ["graphs"]: one frame's rows after another's, in compile order, the same on every run
    (they were in the order of the runtimes' addresses). Four widths: four frames (dynamic=False)."""
    torch._dynamo.reset()
    cgcompile.reset_stats()
    widths = (8, 16, 24, 32)
    runs = [torch.compile(nn.Sequential(nn.Linear(w, w), nn.GELU(), nn.Linear(w, w)), backend="cudagraph_modules",
                          options=OPTIONS, dynamic=False) for w in widths]
    with torch.no_grad():
        for _ in range(3):
            for w, run in zip(widths, runs):
                run(torch.randn(4, w))
    st = cgcompile.stats()
    for rows in (st["partitions"], st["graphs"]):
        frames = [int(row["partition"].split()[1]) for row in rows]
        assert len(set(frames)) == 4 and frames == sorted(frames), frames


def test_zero_grad_between_forward_and_backward_costs_one_eager_step_not_one_per_partition():
    """A GAN generator's step in the DCGAN tutorial's order: forward, zero_grad, backward. The grads the backward
    graphs handed out as .grad are then still alive at the next forward, so the graphs read by them must not
    replay. Every backward graph holding such grads learns it at the first forward that finds one held (its grads
    copied from then on): one eager step for all five partitions, where each partition learned it at a step of
    its own before (10 steps: 5 of them eager)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    reference = copy.deepcopy(model)
    cgcompile.reset_stats()
    torch._dynamo.reset()
    gc.collect()
    run = torch.compile(model, backend="cudagraph_modules", options={**OPTIONS, "min_partition_ops": 1})
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (model, reference)]
    for step in range(10):
        z = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        for fn, opt in ((run, opts[0]), (reference, opts[1])):
            fake = fn(z)
            opt.zero_grad(set_to_none=True)
            fake.square().mean().backward()
            opt.step()
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    partitions = cgcompile.stats()["partitions"]
    # each: the warmup call, the capture call, the one step that learned the grads were kept; 7 replays after
    assert [(p["misses"], p["replays"]) for p in partitions] == [(3, 7)] * 5, partitions

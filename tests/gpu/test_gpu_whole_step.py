"""transformer_engine glue, full_iteration and capture_step with real CUDA graphs; skipped without CUDA.

TE itself is not installable on the machines here: its glue runs through torch.cuda.make_graphed_callables,
which has the same contract."""

import copy

import pytest
import torch

import cgcompile
from tests.models import MODELS

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"


def twins(name="dense_gpt"):
    spec = MODELS[name]
    model = spec.make().to(DEV)
    return spec, model, copy.deepcopy(model)


def train_and_compare(spec, model, reference, compiled, steps=6):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for i in range(steps):
        (tokens,) = spec.example_inputs(seed=i, device=DEV)
        loss, ref = spec.loss(compiled, tokens), spec.loss(reference, tokens)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(loss, ref)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


def test_te_adapter_through_torch_make_graphed_callables():
    spec, model, reference = twins()
    options = spec.options(cuda_graph_impl="transformer_engine",
                           te={"graphing_fn": torch.cuda.make_graphed_callables, "num_warmup_iters": 3})
    cgcompile.reset_stats()
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    train_and_compare(spec, model, reference, compiled)
    assert cgcompile.stats()["graphs_captured"] == 4  # 2 partitions x (forward, backward)
    assert cgcompile.stats()["eager_fallbacks"] == []


def _te_sequential(device="cuda"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(device)
    options = {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": [], "cuda_graph_warmup_steps": 1,
               "te": {"graphing_fn": torch.cuda.make_graphed_callables, "num_warmup_iters": 3}}
    return model, copy.deepcopy(model), torch.compile(model, backend="cudagraph_modules", options=options)


def test_te_outputs_kept_across_calls_and_grads_accumulated_over_micro_batches():
    """make_graphed_callables returns static outputs and static gradient buffers: kept outputs must survive the
    next calls (cloned), and two micro-batches per step must accumulate like eager (grads copied out)."""
    model, reference, compiled = _te_sequential()
    cgcompile.reset_stats()
    kept = []
    for step in range(4):
        for micro in range(2):
            x = torch.randn(8, 64, device=DEV, requires_grad=True)
            out, expected = compiled(x), reference(x)
            kept.append((out, expected.detach()))
            out.square().mean().backward()
            expected.square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        model.zero_grad(), reference.zero_grad()
    for out, expected in kept:
        torch.testing.assert_close(out.detach(), expected)
    st = cgcompile.stats()
    assert st["graphs_captured"] == 2 and st["eager_fallbacks"] == [], st


def test_te_graphs_under_autocast_with_its_cache_on():
    model, reference, compiled = _te_sequential()
    cgcompile.reset_stats()
    for step in range(4):
        x = torch.randn(8, 64, device=DEV)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, ref = compiled(x).float().square().mean(), reference(x).float().square().mean()
        loss.backward(), ref.backward()
        torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
        model.zero_grad(), reference.zero_grad()
    st = cgcompile.stats()
    assert st["graphs_captured"] == 2 and st["eager_fallbacks"] == [], st


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_te_graphs_on_the_models_device():
    model, reference, compiled = _te_sequential("cuda:1")
    cgcompile.reset_stats()
    with torch.cuda.device(0):
        for step in range(4):
            x = torch.randn(8, 64, device="cuda:1")
            torch.testing.assert_close(compiled(x), reference(x))
    assert cgcompile.stats()["graphs_captured"] == 2 and cgcompile.stats()["eager_fallbacks"] == []


def test_full_iteration_dense_is_one_graph_pair():
    spec, model, reference = twins()
    cgcompile.reset_stats()
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"cuda_graph_impl": "full_iteration", "driver": "cuda"})
    train_and_compare(spec, model, reference, compiled)
    st = cgcompile.stats()
    assert st["graphs_captured"] == 2 and st["steady_replays"] == 2 * (6 - 3 - 1) and st["eager_fallbacks"] == []


def test_capture_step_trains_like_eager():
    spec, model, reference = twins()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3, capturable=True)

    def make_step(m, o):
        def step(tokens):
            o.zero_grad(set_to_none=True)
            loss = spec.loss(m, tokens)
            loss.backward()
            o.step()
            return loss.detach()
        return step

    cgcompile.reset_stats()
    step = cgcompile.capture_step(make_step(model, opt), warmup_steps=3, driver="cuda")
    ref_step = make_step(reference, ref_opt)
    for i in range(8):
        (tokens,) = spec.example_inputs(seed=i, device=DEV)
        torch.testing.assert_close(step(tokens), ref_step(tokens))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert cgcompile.stats()["graphs_captured"] == 1 and cgcompile.stats()["steady_replays"] == 4


def test_capture_step_forward_only_validation():
    spec, model, _ = twins()
    model.eval()
    evaluate = cgcompile.capture_step(lambda tokens: spec.loss(model, tokens), warmup_steps=2, driver="cuda")
    with torch.no_grad():
        for i in range(5):
            (tokens,) = spec.example_inputs(seed=i, device=DEV)
            torch.testing.assert_close(evaluate(tokens), spec.loss(model, tokens))

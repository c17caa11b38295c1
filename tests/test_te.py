"""cuda_graph_impl="transformer_engine": the glue around make_graphed_callables, tested on CPU with the emulate
driver's equivalent (TE itself cannot be installed here; tests/gpu runs it through torch's make_graphed_callables)."""

import copy
import importlib.util

import pytest
import torch

import cgcompile
from cgcompile.runtime.frame.te_emulation import emulated_make_graphed_callables
from cgcompile import reset_stats, stats
from tests.models import MODELS
from tests.parity import assert_step_matches_eager


def te_options(spec, **te):
    return spec.options(cuda_graph_impl="transformer_engine", te=te)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed")
def test_missing_transformer_engine_is_one_clear_error_at_first_compile():
    spec = MODELS["dense_gpt"]
    compiled = torch.compile(spec.make(), backend="cudagraph_modules", options=te_options(spec))
    with pytest.raises(Exception) as info:
        compiled(*spec.example_inputs())
    text = str(info.value)
    assert "cuda_graph_impl='transformer_engine' needs Transformer Engine" in text
    assert 'pip install "cgcompile[te]"' in text and "cuda_graph_impl='local'" in text


@pytest.mark.parametrize("name", ["dense_gpt", "moe_mask"])
def test_graphed_partitions_train_like_eager(name):
    spec = MODELS[name]
    model = spec.make()
    reference = copy.deepcopy(model)
    calls = []

    def graphing_fn(callables, sample_args, **kwargs):
        calls.append((len(callables), kwargs))
        return emulated_make_graphed_callables(callables, sample_args, **kwargs)

    options = te_options(spec, graphing_fn=graphing_fn, num_warmup_iters=2)
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    (tokens,) = spec.example_inputs()
    reset_stats()
    with torch._dynamo.config.patch(**spec.dynamo_flags()):
        for _ in range(6):
            assert_step_matches_eager(spec, compiled, model, reference, tokens)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
    assert calls == [(2, {"num_warmup_iters": 2})]  # all captured partitions of the frame at once, TE args passed
    assert stats()["graphs_captured"] == 4 and stats()["eager_fallbacks"] == []  # 2 x (forward, backward)


def test_failing_graphing_falls_back_to_eager_once_with_a_logged_reason(caplog):
    spec = MODELS["dense_gpt"]
    model = spec.make()
    reference = copy.deepcopy(model)

    def graphing_fn(callables, sample_args, **kwargs):
        raise RuntimeError("no hooks allowed")

    compiled = torch.compile(model, backend="cudagraph_modules", options=te_options(spec, graphing_fn=graphing_fn))
    (tokens,) = spec.example_inputs()
    reset_stats()
    with caplog.at_level("WARNING", logger="cgcompile"):
        for _ in range(5):
            torch.testing.assert_close(compiled(tokens), reference(tokens), rtol=0, atol=0)
    warnings = [r for r in caplog.records if "transformer_engine graphing" in r.getMessage()]
    assert len(warnings) == 1 and "no hooks allowed" in warnings[0].getMessage()
    assert {f["reason"] for f in stats()["eager_fallbacks"]} == {
        "transformer_engine graphing failed: RuntimeError: no hooks allowed"}


def test_non_tensor_partition_boundaries_are_reported_at_plan_time():
    spec = MODELS["dense_gpt"]
    model = spec.make()
    (tokens,) = spec.example_inputs()
    torch._dynamo.mark_dynamic(tokens, 1)
    plan = cgcompile.explain(model, tokens, options=te_options(spec, graphing_fn=emulated_make_graphed_callables))
    reasons = [r for g in plan.graphs for p in g.partitions for r in p.reasons if r.category == "te_restriction"]
    assert reasons, str(plan)
    assert "tensors only" in reasons[0].detail and "use cuda_graph_impl='local'" in reasons[0].hint


def test_frame_reused_for_several_layers_is_not_graphed():
    """Sort dispatch graph-breaks inside each layer, so Dynamo runs every layer through one compiled frame;
    make_graphed_callables would copy one layer's parameters over another's: that frame stays eager."""
    spec = MODELS["moe_sort"]
    model = spec.make()
    reference = copy.deepcopy(model)
    options = te_options(spec, graphing_fn=emulated_make_graphed_callables)
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    (tokens,) = spec.example_inputs()
    reset_stats()
    for _ in range(5):
        assert_step_matches_eager(spec, compiled, model, reference, tokens)
    reasons = {f["reason"] for f in stats()["eager_fallbacks"]}
    assert any("parameter sets" in r for r in reasons), reasons


def _grad_accumulator(t):
    """The AccumulateGrad node autograd routes t's gradient to (created on first use, shared while alive)."""
    return t.view_as(t).grad_fn.next_functions[0][0]


def test_parameter_samples_are_fresh_leaves_on_the_parameters_memory():
    """Issue 12.2: the caller keeps the previous step's loss (and so its graph and every parameter's
    AccumulateGrad node, made on the default stream) alive while the frame graphs. Were a parameter its own
    sample, the captured backward would send its gradient to that node's stream and the CUDA capture fail.
    The samples must share the parameters' memory (no per-call copy) without sharing their grad accumulator."""
    spec = MODELS["dense_gpt"]
    model = spec.make()
    params = {p.data_ptr(): p for p in model.parameters()}
    seen = []

    def graphing_fn(callables, sample_args, **kwargs):
        seen.extend(a for sample in sample_args for a in sample if a.data_ptr() in params)
        return emulated_make_graphed_callables(callables, sample_args, **kwargs)

    compiled = torch.compile(model, backend="cudagraph_modules", options=te_options(spec, graphing_fn=graphing_fn))
    loss = None
    for step in range(4):
        (tokens,) = spec.example_inputs(seed=step)
        loss = spec.loss(compiled, tokens)  # the previous step's loss lives until this returns, as in a loop
        loss.backward()
    assert len(seen) == 2 * 12  # two layers' partitions, 12 parameters each
    for sample in seen:
        param = params[sample.data_ptr()]
        assert sample is not param and sample.is_leaf and sample.requires_grad
        assert _grad_accumulator(sample) is not _grad_accumulator(param)


def _te_frame(name="dense_gpt", graphing_fn=emulated_make_graphed_callables):
    spec = MODELS[name]
    model = spec.make()
    reference = copy.deepcopy(model)
    options = te_options(spec, graphing_fn=graphing_fn, num_warmup_iters=1)
    return spec, model, reference, torch.compile(model, backend="cudagraph_modules", options=options)


def test_outputs_kept_across_calls_are_not_overwritten():
    """A graphed callable returns the same static output tensors every call; the frame's outputs living there
    are cloned, so an output kept from one call still holds its values after the next calls."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    reference = copy.deepcopy(model)
    options = {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": [], "cuda_graph_warmup_steps": 1,
               "te": {"graphing_fn": emulated_make_graphed_callables, "num_warmup_iters": 1}}
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    reset_stats()
    batches = [torch.randn(4, 8, requires_grad=True) for _ in range(5)]
    kept = [(compiled(x), reference(x)) for x in batches]
    assert stats()["graphs_captured"] == 2 and stats()["eager_fallbacks"] == []
    for got, want in kept:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    kept[-1][0].sum().backward()  # a clone passes gradients through
    kept[-1][1].sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_gradients_accumulate_over_micro_batches_like_eager():
    """The graphed backward returns static gradient buffers; autograd would keep one as a parameter's .grad (it
    does when .grad is None, i.e. after zero_grad()), which the next micro-batch's replays overwrite.
    fwd, bwd, fwd, bwd per step, then step and zero_grad."""
    spec, model, reference, compiled = _te_frame()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    reset_stats()
    for step in range(5):
        for micro in range(2):
            (tokens,) = spec.example_inputs(seed=10 * step + micro)
            spec.loss(compiled, tokens).backward()
            spec.loss(reference, tokens).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert stats()["graphs_captured"] == 4 and stats()["eager_fallbacks"] == []


def test_graphing_under_autocast_with_its_weight_cache():
    """make_graphed_callables refuses an active autocast whose cache is on (autocast's default): the frame graphs
    with the cache off instead of running eagerly for good."""
    spec, model, reference, compiled = _te_frame()
    reset_stats()
    for step in range(5):
        (tokens,) = spec.example_inputs(seed=step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, ref = spec.loss(compiled, tokens), spec.loss(reference, tokens)
            assert torch.is_autocast_cache_enabled()
        loss.backward(), ref.backward()
        torch.testing.assert_close(loss, ref)
        model.zero_grad(), reference.zero_grad()
    assert stats()["eager_fallbacks"] == [] and stats()["graphs_captured"] == 4


def test_release_runs_the_partitions_eagerly_and_graphs_them_again():
    """Graphing replaces a module callable's forward: the split submodules must not be those modules, or after
    release() the 'eager' partitions would still replay the old graphs (and graphing again would graph them)."""
    handed = []

    def graphing_fn(callables, sample_args, **kwargs):
        handed.append([c for c in callables if "forward" in vars(c)])  # a forward a previous graphing replaced
        return emulated_make_graphed_callables(callables, sample_args, **kwargs)

    spec, model, reference, compiled = _te_frame(graphing_fn=graphing_fn)
    reset_stats()
    for step in range(8):
        if step == 4:
            cgcompile.release()
        assert_step_matches_eager(spec, compiled, model, reference, spec.example_inputs(seed=step)[0])
        model.zero_grad(), reference.zero_grad()
    assert stats()["graphs_captured"] == 8 and stats()["eager_fallbacks"] == []
    assert handed == [[], []]  # graphed twice, each time modules no graphing had touched


def test_the_emulation_keeps_make_graphed_callables_contract():
    """One static instance: outputs and gradients are the same static tensors every call, a second forward before
    the first backward leaves both backwards with the latest forward's gradients, autocast's cache is refused."""
    weight = torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(2, 3, requires_grad=True)
    graphed = emulated_make_graphed_callables(lambda a, w: a @ w, (x.detach().clone().requires_grad_(), weight),
                                              num_warmup_iters=1)
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    out_a = graphed(a, weight)
    out_b = graphed(b, weight)
    assert out_a.data_ptr() == out_b.data_ptr()  # the first output now holds the second call's values
    torch.testing.assert_close(out_a, b @ weight)
    grad_a, = torch.autograd.grad(out_a.sum(), a)
    grad_b, = torch.autograd.grad(out_b.sum(), b)
    torch.testing.assert_close(grad_a, grad_b)
    w_first, = torch.autograd.grad(graphed(a, weight).sum(), weight)
    w_second, = torch.autograd.grad(graphed(b, weight).sum(), weight)
    assert w_first.data_ptr() == w_second.data_ptr()  # the parameter's gradient is one static buffer
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="autocast caching"):
        emulated_make_graphed_callables(lambda a: a * 2, (x,))

"""The tiny test models in tests/models run forward+backward in eager mode, deterministically, with the
tags and dispatch-line markers that the compiler tests rely on."""

from __future__ import annotations

import inspect
import linecache
import sys

import pytest
import torch

import cgcompile

try:
    from tests.models import MODELS, dense_gpt, hf_style, moe
except ModuleNotFoundError:  # tests/ itself on sys.path (pytest rootdir-less import mode)
    from models import MODELS, dense_gpt, hf_style, moe

NAMES = sorted(MODELS)
VOCAB = 64


def test_registry():
    assert set(MODELS) == {"dense_gpt", "moe_mask", "moe_sort", "mamba", "hf_style", "mixtral", "qwen_moe"}
    assert MODELS["dense_gpt"].cuda_graph_modules == ("attn", "mlp")
    assert MODELS["moe_mask"].cuda_graph_modules == ("attn", "moe_router", "moe_preprocess")
    assert MODELS["moe_sort"].cuda_graph_modules == ("attn", "moe_router", "moe_preprocess")
    assert MODELS["mamba"].cuda_graph_modules == ("mamba",)
    assert MODELS["hf_style"].cuda_graph_modules == ("attn", "mlp")
    assert MODELS["moe_mask"].dispatch == "mask" and MODELS["moe_sort"].dispatch == "sort"
    assert MODELS["moe_mask"].build().layers[0].moe.dispatch == "mask"
    assert MODELS["moe_sort"].build().layers[0].moe.dispatch == "sort"
    opts = MODELS["moe_mask"].options(cuda_graph_warmup_steps=0)
    assert opts == {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "moe_router", "moe_preprocess"],
                    "cuda_graph_warmup_steps": 0}


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_all_params_get_grads(name):
    spec = MODELS[name]
    model = spec.make(num_layers=2, seed=0)
    (tokens,) = spec.example_inputs(batch=2, seq=8, seed=0)
    logits = model(tokens)
    assert logits.shape == (2, 8, VOCAB) and logits.dtype == torch.float32
    loss = spec.loss(model, tokens)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    params = dict(model.named_parameters())
    assert params
    missing = [n for n, p in params.items() if p.grad is None]
    assert not missing, f"{name}: no gradient for {missing}"
    bad = [n for n, p in params.items() if not torch.isfinite(p.grad).all()]
    assert not bad, f"{name}: non-finite gradient for {bad}"
    zero = [n for n, p in params.items() if p.grad.abs().max() == 0]
    assert not zero, f"{name}: all-zero gradient for {zero} (a parity test would compare nothing there)"


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_and_leaves_global_rng_alone(name):
    spec = MODELS[name]
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    a, b, c = spec.build(seed=0), spec.build(seed=0), spec.build(seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    (x0,), (x1,), (x2,) = spec.example_inputs(seed=0), spec.example_inputs(seed=0), spec.example_inputs(seed=1)
    assert torch.equal(x0, x1) and not torch.equal(x0, x2)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a(x0), b(x0))


@pytest.mark.parametrize("name", NAMES)
def test_example_inputs_and_sizes(name):
    spec = MODELS[name]
    (tokens,) = spec.example_inputs(batch=3, seq=5, seed=2)
    assert tokens.shape == (3, 5) and tokens.dtype == torch.int64
    assert 0 <= int(tokens.min()) and int(tokens.max()) < VOCAB
    model = spec.make(num_layers=3, seed=0)
    assert len(_layers(model)) == 3
    assert model(tokens).shape == (3, 5, VOCAB)


def _layers(model):
    return model.model.layers if hasattr(model, "model") else model.layers


# ---- MoE dispatch -----------------------------------------------------------------------------------------

def _fwd_bwd(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    moe.loss(model, tokens).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("num_layers,seed", [(2, 0), (3, 1)])
def test_moe_dispatch_styles_agree(num_layers, seed):
    (tokens,) = moe.example_inputs(batch=2, seq=8, seed=seed)
    variants = [moe.build(num_layers, seed, dispatch="mask"), moe.build(num_layers, seed, dispatch="sort"),
                moe.build(num_layers, seed, dispatch="sort", sort_counts="preprocess")]
    ref_out, ref_grads = _fwd_bwd(variants[0], tokens)
    for model in variants[1:]:
        out, grads = _fwd_bwd(model, tokens)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for n in grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_moe_router_and_preprocess_shapes():
    block = moe.build(seed=0).layers[0].moe
    h = torch.randn(16, moe.D_MODEL, generator=torch.Generator().manual_seed(0))
    weights, ids = block.router(h)
    assert weights.shape == ids.shape == (16, moe.TOP_K) and ids.dtype == torch.int64
    torch.testing.assert_close(weights.sum(-1), torch.ones(16))
    mask, combine, counts = block.preprocess(weights, ids)
    assert mask.shape == combine.shape == (16, moe.NUM_EXPERTS)
    assert torch.equal(mask.sum(1), torch.full((16,), moe.TOP_K))
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=moe.NUM_EXPERTS))
    torch.testing.assert_close(combine.sum(1), torch.ones(16))


def test_moe_build_rejects_unknown_dispatch():
    with pytest.raises(ValueError, match="dispatch"):
        moe.build(dispatch="capacity")
    with pytest.raises(ValueError, match="sort_counts"):
        moe.build(dispatch="sort", sort_counts="cumsum")


_KIND_TEXT = {"nonzero": "torch.nonzero(", "gather": "[idx]", "combine": "index_add_(", "bincount": "torch.bincount(",
              "tolist": ".tolist()", "split": "torch.split("}


def _text(line):
    return linecache.getline(moe.SOURCE_FILE, line)


def test_dispatch_lines_name_the_data_dependent_ops():
    forward_src, forward_start = inspect.getsourcelines(moe.MoE.forward)
    in_forward = range(forward_start, forward_start + len(forward_src))

    mask_lines = moe.dispatch_lines("mask")
    assert len(mask_lines) == 1
    assert any(k in _text(mask_lines[0]) for k in ("nonzero", "where"))

    sort_lines = moe.dispatch_lines("sort")
    assert len(sort_lines) == 2
    assert [l for l in sort_lines if ".tolist()" in _text(l)] == moe.dispatch_lines("sort", kinds=("tolist",))
    assert "bincount" in _text(moe.dispatch_lines("sort", kinds="bincount")[0])

    for style in moe.DISPATCH_STYLES:
        sites = moe.dispatch_sites(style)
        assert set(moe.ORIGIN_KINDS[style]) <= set(sites)
        assert moe.dispatch_lines(style, kinds="all") == sorted(l for ls in sites.values() for l in ls)
        for kind, lines in sites.items():
            assert len(lines) == 1, (style, kind, lines)
            assert lines[0] in in_forward
            assert _KIND_TEXT[kind] in _text(lines[0]), (style, kind, _text(lines[0]))
    assert not set(moe.dispatch_lines("mask", "all")) & set(moe.dispatch_lines("sort", "all"))
    with pytest.raises(ValueError):
        moe.dispatch_lines("mask", kinds=("tolist",))


@pytest.mark.parametrize("dispatch,sort_counts", [("mask", "bincount"), ("sort", "bincount"), ("sort", "preprocess")])
def test_dispatch_lines_are_executed(dispatch, sort_counts):
    """Every marked line of the chosen style runs; no line of the other style does."""
    model = moe.build(seed=0, dispatch=dispatch, sort_counts=sort_counts)
    (tokens,) = moe.example_inputs()
    executed = set()
    target = moe.MoE.forward.__code__

    def tracer(frame, event, arg):
        if event == "call":
            return local if frame.f_code is target else None
        return None

    def local(frame, event, arg):
        if event == "line":
            executed.add(frame.f_lineno)
        return local

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        model(tokens)
    finally:
        sys.settrace(old)
    expected = set(moe.dispatch_lines(dispatch, "all"))
    if sort_counts == "preprocess":
        expected -= set(moe.dispatch_lines("sort", "bincount"))
    assert expected <= executed
    other = "sort" if dispatch == "mask" else "mask"
    assert not set(moe.dispatch_lines(other, "all")) & executed
    if sort_counts == "preprocess":
        assert not set(moe.dispatch_lines("sort", "bincount")) & executed


# ---- tags -------------------------------------------------------------------------------------------------

def test_dense_tags():
    model = MODELS["dense_gpt"].make()
    for layer in model.layers:
        assert cgcompile.tag_of(layer.attn) == "attn"
        assert cgcompile.tag_of(layer.mlp) == "mlp"
        assert cgcompile.tag_of(layer) is None and cgcompile.tag_of(layer.ln1) is None
    assert cgcompile.tag_of(model) is None and cgcompile.tag_of(model.lm_head) is None


@pytest.mark.parametrize("name", ["moe_mask", "moe_sort"])
def test_moe_tags(name):
    model = MODELS[name].make()
    for layer in model.layers:
        assert cgcompile.tag_of(layer.attn) == "attn"
        assert cgcompile.tag_of(layer.moe) == "moe"
        assert cgcompile.tag_of(layer.moe.router) == "moe_router"
        assert cgcompile.tag_of(layer.moe.preprocess) == "moe_preprocess"
        assert all(cgcompile.tag_of(e) is None for e in layer.moe.experts)
        assert cgcompile.tag_of(layer.attn_norm) is None


def test_mamba_tags():
    model = MODELS["mamba"].make()
    for layer in model.layers:
        assert cgcompile.tag_of(layer.mamba) == "mamba"
        assert cgcompile.tag_of(layer.norm) is None and cgcompile.tag_of(layer) is None


def test_hf_style_untagged_until_prepared():
    spec = MODELS["hf_style"]
    model = spec.build()
    assert all(cgcompile.tag_of(m) is None for m in model.modules())
    (tokens,) = spec.example_inputs()
    before = model(tokens)
    assert spec.prepare(model) is model
    tagged = {n: cgcompile.tag_of(m) for n, m in model.named_modules() if cgcompile.tag_of(m)}
    assert tagged == {f"model.layers.{i}.self_attn": "attn" for i in range(2)} | \
                     {f"model.layers.{i}.mlp": "mlp" for i in range(2)}
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)
    assert isinstance(model.model.layers[0].self_attn, hf_style.LlamaAttention)
    # instance tags do not leak onto the class or onto a fresh build
    assert cgcompile.tag_of(hf_style.LlamaAttention) is None
    assert all(cgcompile.tag_of(m) is None for m in spec.build().modules())


def test_hf_style_shares_no_classes_with_dense():
    dense_classes = {type(m) for m in dense_gpt.build().modules()}
    hf_classes = {type(m) for m in hf_style.build().modules()}
    torch_classes = {c for c in dense_classes | hf_classes if c.__module__.startswith("torch.")}
    assert not (dense_classes & hf_classes) - torch_classes
    assert not any(cgcompile.tag_of(c) for c in torch_classes)
    for c in hf_classes - torch_classes:
        assert not issubclass(c, (dense_gpt.SelfAttention, dense_gpt.MLP))


# ---- dropout ----------------------------------------------------------------------------------------------

def test_dense_dropout_only_in_training():
    (tokens,) = dense_gpt.example_inputs()
    model = dense_gpt.build(dropout=0.2)
    assert model.layers[0].attn.dropout == 0.2
    model.train()
    torch.manual_seed(0)
    a = model(tokens)
    b = model(tokens)
    assert not torch.equal(a, b)
    torch.manual_seed(0)
    torch.testing.assert_close(model(tokens), a, rtol=0, atol=0)
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens), rtol=0, atol=0)
    no_dropout = dense_gpt.build(dropout=0.0).train()
    torch.testing.assert_close(no_dropout(tokens), model(tokens))

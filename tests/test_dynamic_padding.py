"""dynamic_padding: the MoE expert loop captured exactly ("max": no sync; "buckets": one graph per bucket)."""

import copy
import linecache
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

import cgcompile
from cgcompile import reset_stats, stats
from cgcompile.backend import record_plans
from cgcompile.config import CudaGraphConfig
from cgcompile.rewrites.padding import bucket_for, pad_dynamic_rows
from cgcompile.passes.padding_marks import is_bucketed_producer
from cgcompile.passes.common import op_key
from cgcompile.passes.row_flow import row_flow
from cgcompile.passes.sync_ops import find_host_syncs
from cgcompile.profiling import HostOpCounter
from tests.models import MODELS
from tests.padding_run import STEPS, padding_options as _options, train_like_eager as _train_like_eager

PADDED_MODELS = ["moe_mask", "mixtral", "qwen_moe"]


def _line_of(path, marker):
    return next(i for i, text in enumerate(linecache.getlines(path), 1) if marker in text)


@pytest.mark.parametrize("mode", ["max", "buckets"])
@pytest.mark.parametrize("name", PADDED_MODELS)
def test_padded_experts_are_captured_and_train_like_eager(name, mode):
    spec = MODELS[name]
    model = spec.make()
    reference = copy.deepcopy(model)
    with torch._dynamo.config.patch(spec.dynamo_flags()), record_plans() as rec:
        compiled = torch.compile(model, backend="cudagraph_modules", options=_options(mode))
        reset_stats()
        _train_like_eager(spec, model, compiled, reference)
    (graph,) = [g for g in rec.graphs if g.training][:1]
    padded = [p for p in graph.partitions if p.captured and p.padding]
    assert padded and all(p.padding["mode"] == mode for p in padded)
    assert sum(p.padding["producers"] for p in padded) == 2 * 4  # 2 layers x 4 experts
    eager_reasons = {r.category for p in graph.partitions if not p.captured for r in p.reasons}
    assert "dynamic_shape" not in eager_reasons
    if mode == "max":  # no host read left: everything but the tiny embedding lookup is captured
        assert eager_reasons <= {"too_small"}
    else:  # only the bucketed count reads stay eager, one per expert
        assert eager_reasons <= {"too_small", "host_sync"}
    assert stats()["steady_replays"] > 0 and not stats()["eager_fallbacks"]


@pytest.mark.parametrize("mode", ["max", "buckets"])
def test_grad_accumulation_and_train_eval_switch(mode):
    spec = MODELS["mixtral"]
    model = spec.make()
    reference = copy.deepcopy(model)
    with torch._dynamo.config.patch(spec.dynamo_flags()):
        compiled = torch.compile(model, backend="cudagraph_modules", options=_options(mode))
        _train_like_eager(spec, model, compiled, reference, steps=3, accumulate=2)  # fwd, bwd, fwd, bwd
        (tokens,) = spec.example_inputs(seed=7)
        first, second = compiled(tokens), compiled(spec.example_inputs(seed=8)[0])  # fwd, fwd, then both bwd
        (first.sum() + second.sum()).backward()
        (reference(tokens).sum() + reference(spec.example_inputs(seed=8)[0]).sum()).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
        model.eval(), reference.eval()
        with torch.no_grad():
            for seed in range(3):
                (tokens,) = spec.example_inputs(seed=50 + seed)
                torch.testing.assert_close(compiled(tokens), reference(tokens), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", PADDED_MODELS)
def test_rows_mixed_by_a_mean_stay_eager_with_not_paddable(name):
    spec = MODELS[name]
    model = spec.make(row_mixing=True)
    reference = copy.deepcopy(model)
    (tokens,) = spec.example_inputs()
    with torch._dynamo.config.patch(spec.dynamo_flags()):
        plan = cgcompile.explain(model, tokens, options=_options("max"))
        compiled = torch.compile(model, backend="cudagraph_modules", options=_options("max"))
        _train_like_eager(spec, model, compiled, reference, steps=2)
    reasons = [r for g in plan.graphs for p in g.partitions if not p.captured for r in p.reasons
               if r.category == "not_paddable"]
    assert len(reasons) == 2  # one eager island per layer (its 4 experts share the reason's line)
    source = getattr(spec.module, "SOURCE_FILE", spec.module.__file__)  # moe: the model lives in cgcompile.examples
    op, where = ("torch.nonzero", "# DISPATCH(mask): nonzero") if name == "moe_mask" else \
        ("torch.where", "# MIXTRAL: where")
    mean = _line_of(source, "# ROW_MIXING: mean" if name == "moe_mask" else "# MIXTRAL: mean")
    first = reasons[0]
    assert (first.op, first.location) == ("Tensor.mean", f"{source}:{mean}")
    assert first.detail.startswith(f"{op} at {source}:{_line_of(source, where)} stays eager: mean combines the")
    assert "sum the rows (masked)" in first.hint
    assert not any(p.padding for g in plan.graphs for p in g.partitions if p.captured)


def test_full_iteration_with_max_captures_the_moe_step_whole():
    spec = MODELS["moe_mask"]
    model = spec.make()
    reference = copy.deepcopy(model)
    options = _options("max", cuda_graph_impl="full_iteration")
    (tokens,) = spec.example_inputs()
    with torch._dynamo.config.patch(spec.dynamo_flags()):
        plan = cgcompile.explain(model, tokens, options=options)
        assert [p.kind for g in plan.graphs for p in g.partitions] == ["capture"]
        compiled = torch.compile(model, backend="cudagraph_modules", options=options)
        reset_stats()
        _train_like_eager(spec, model, compiled, reference, steps=4)
    assert stats()["graphs_captured"] == 2  # one forward graph, one backward graph


def test_off_mode_says_padding_would_capture_the_island():
    spec = MODELS["moe_mask"]
    (tokens,) = spec.example_inputs()
    with torch._dynamo.config.patch(spec.dynamo_flags()):
        plan = cgcompile.explain(spec.make(num_layers=1), tokens, options=_options("off"))
    origin = next(r for g in plan.graphs for p in g.partitions for r in p.reasons if r.op == "torch.nonzero")
    assert_expected_inline(origin.hint, """set dynamic_padding='max' (no host sync) or 'buckets' to capture the rows it selects; the padding is exact""")


def test_plan_table_shows_padded_partitions():
    spec = MODELS["moe_mask"]
    (tokens,) = spec.example_inputs()
    with torch._dynamo.config.patch(spec.dynamo_flags()):
        table = str(cgcompile.explain(spec.make(num_layers=1), tokens,
                                      options=_options("buckets", dynamic_padding_buckets=[4, 8])))
    assert_expected_inline("\n".join(table.splitlines()[2:6]), """\
id  kind     tags                                module        ops  first reason
 0  capture  attn+moe+moe_router+moe_preprocess  -              39  -
 1  eager    moe                                 layers.0.moe    2  host_sync: torch.nonzero at moe.py:172
 2  capture  moe                                 layers.0       58  padded buckets: 4 producers, <= 16 rows, buckets 4,8""")
    assert "host_sync: torch.nonzero" in table.splitlines()[4]  # one host read for the 4 experts


def test_padding_cuts_host_ops_and_syncs():
    """The CPU proxy for launch overhead: kernel ops run outside graphs, and host reads of device data."""
    spec = MODELS["moe_mask"]
    counts = {}
    for mode in ("eager", "max"):
        torch._dynamo.reset()
        model = spec.make()
        with torch._dynamo.config.patch(spec.dynamo_flags()):
            run = model if mode == "eager" else torch.compile(model, backend="cudagraph_modules",
                                                               options=_options(mode))
            for seed in range(3):
                spec.loss(run, spec.example_inputs(seed=seed)[0]).backward()
            with HostOpCounter() as counter:
                spec.loss(run, spec.example_inputs(seed=9)[0]).backward()
        counts[mode] = counter
    assert counts["eager"].syncs == 2 * 4 and counts["max"].syncs == 0
    assert counts["max"].ops * 5 < counts["eager"].ops
    assert counts["max"].replays > 0


def test_bucket_bank_overflow_runs_eagerly_logged_and_counted(caplog):
    """More bucket sizes than max_graphs_per_partition: the overflow runs eagerly (exactly), once logged."""
    spec = MODELS["moe_mask"]
    model = spec.make(num_layers=1)
    reference = copy.deepcopy(model)
    options = _options("buckets", dynamic_padding_buckets=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
                       max_graphs_per_partition=1)
    with torch._dynamo.config.patch(spec.dynamo_flags()), caplog.at_level(logging.WARNING, "cgcompile"):
        compiled = torch.compile(model, backend="cudagraph_modules", options=options)
        reset_stats()
        _train_like_eager(spec, model, compiled, reference, steps=STEPS)
    overflows = [f for f in stats()["eager_fallbacks"] if "max_graphs_per_partition=1" in f["reason"]]
    assert overflows and stats()["steady_replays"] > 0
    logged = [r for r in caplog.records if "max_graphs_per_partition=1 reached" in r.getMessage()]
    assert len(logged) == len({f["partition"] for f in overflows})  # once per partition


def _dynamo_graph(fn, *inputs):
    """The one FX graph Dynamo makes of fn, with the data-dependent index ops kept in it."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    (gm,) = graphs
    return gm


def _padded_graph(fn, *inputs, mode="buckets"):
    """Dynamo's graph of fn, rewritten by pad_dynamic_rows; its bucketed reads (each a list of masks)."""
    gm = _dynamo_graph(fn, *inputs)
    pad_dynamic_rows(gm, CudaGraphConfig.from_options({"dynamic_padding": mode}))
    reads = [n for n in gm.graph.nodes if is_bucketed_producer(n)]
    return gm, [len(n.args[0]) for n in reads]


def _experts(x, masks, between=None):
    out = torch.zeros_like(x)
    for e in range(3):
        idx = torch.nonzero(masks[e]).squeeze(-1)
        out.index_add_(0, idx, torch.tanh(x[idx]) * (e + 1))
        if between is not None:
            masks = between(masks, out)
    return out


@pytest.mark.parametrize("between, groups", [
    (None, [3]),  # every mask is ready before the first expert: one host read
    (lambda m, out: m, [3]),
    (lambda m, out: m.clone(), [3]),  # masks computed in the loop, each from the last: hoisted in order
    (lambda m, out: m.logical_not_(), [1, 1, 1]),  # a mask written between experts: cannot be read early
    (lambda m, out: m & (out.sum(1) > 0), [1, 1, 1]),  # the next mask depends on the previous expert
])
def test_bucketed_producers_share_one_host_read_only_when_their_masks_are_ready(between, groups):
    x, masks = torch.randn(6, 3), torch.rand(3, 6) > 0.5
    expected = _experts(x, masks.clone(), between)
    gm, found = _padded_graph(lambda x, m: _experts(x, m, between), x, masks.clone())
    assert found == groups
    torch.testing.assert_close(gm(x, masks.clone())[0], expected, rtol=0, atol=0)


def test_only_the_bucketed_read_itself_is_a_host_sync():
    """The call, its per-mask results and the read of their common size stay eager; indexing the padded rows
    (`nonzero(m)[:, 0]`) is device work after it."""
    def fn(x, masks):
        out = torch.zeros_like(x)
        for e in range(2):
            idx = torch.nonzero(masks[e])[:, 0]
            out.index_add_(0, idx, x[idx] * 2)
        return out

    x, masks = torch.randn(6, 3), torch.rand(2, 6) > 0.5
    gm, found = _padded_graph(fn, x, masks)
    assert found == [2]
    syncs = sorted(op_key(n) for n in find_host_syncs(gm))
    assert syncs == ["getitem", "getitem", "nonzero_bucketed", "sym_size"], syncs
    torch.testing.assert_close(gm(x, masks)[0], fn(x, masks), rtol=0, atol=0)


def test_bucket_for_rounds_up_within_the_bound():
    assert [bucket_for(n, 16, ()) for n in (0, 1, 3, 5, 9, 16)] == [1, 1, 4, 8, 16, 16]
    assert [bucket_for(n, 12, (4, 8)) for n in (0, 4, 5, 9)] == [4, 4, 8, 12]


def _flow(fn, *inputs):
    gm = _dynamo_graph(fn, *inputs)
    origin = next(n for n in gm.graph.nodes if "nonzero" in str(n.target))
    (sym,) = origin.meta["example_value"].shape[0].node.expr.free_symbols
    return row_flow(gm, sym, allow_sinks=True)


def test_a_frame_output_carrying_selected_rows_is_named_by_its_producer_and_line():
    def fn(x):
        rows = torch.nonzero(x[:, 0] > 0).squeeze(-1)
        return x[rows] * 2  # RETURNED

    flow = _flow(fn, torch.randn(6, 3))
    line = fn.__code__.co_firstlineno + 2
    assert flow.blocker.op == "operator.mul" and flow.blocker.location.endswith(f"test_dynamic_padding.py:{line}")
    assert "returns operator.mul's result" in flow.blocker.detail, flow.blocker


@pytest.mark.parametrize("body, blocker", [
    (lambda x, rows: torch.zeros_like(x).index_add_(0, rows, F.silu(x[rows] @ x.T @ x)), None),
    (lambda x, rows: x[rows].sum(0), None),
    (lambda x, rows: torch.zeros_like(x).index_add_(0, rows, torch.softmax(x[rows], 0)), "softmax works across"),
    (lambda x, rows: torch.zeros_like(x).index_add_(0, rows, x[rows] / rows.shape[0]), "as a Python number"),
    (lambda x, rows: x[rows], "the compiled frame returns"),
    (lambda x, rows: x[rows].reshape(-1).sum(), "merges the"),
    (lambda x, rows: x[rows].T.reshape(x.shape[1], -1).sum(1), None),  # (3, u0) -> (3, u0): rows stay whole
    (lambda x, rows: x[rows].reshape(x.shape[1], -1).sum(1), "moves rows into other rows"),
    # the first two rows: torch 2.13 sizes them Min(2, u0) (merged), 2.11 by a new symbol (the rows combined)
    (lambda x, rows: x[rows][:2].sum(0), "merges the|combines the"),
    (lambda x, rows: x.index_copy(0, rows, x[rows]), "overwrites rows"),
])
def test_row_flow_tells_rowwise_from_row_mixing(body, blocker):
    flow = _flow(lambda x: body(x, torch.nonzero(x[:, 0] > 0).squeeze(-1)), torch.randn(6, 3))
    if blocker is None:
        assert flow.ok and flow.sinks
    else:
        assert not flow.ok and re.search(blocker, flow.blocker.detail), flow.blocker

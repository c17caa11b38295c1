"""rewrites/intermediate_writes.py: an intermediate's functional write (aot_autograd's form of a model's in-place
write to a tensor it made) done in place again by torch.fx's reinplace, unless a rewritten value's layout would
change under a later reader. Graphs from torch.func.functionalize + make_fx, each run against the eager function."""

from __future__ import annotations

import copy

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cgcompile.rewrites.intermediate_writes import write_intermediates_in_place

aten = torch.ops.aten


def functional(fn, *args):
    return make_fx(torch.func.functionalize(fn, remove="mutations"))(*args)


def ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def combine(rows, index):  # an MoE combine: expert rows written into a zero buffer the function made
    out = torch.zeros(6, rows.shape[1])
    out.index_put_((index,), rows * 2, accumulate=True)
    return out.relu()


def strided_sum(x):  # `y[::2] + 1` written into the strided slice would hand `view` a strided tensor
    y = x * 2
    z = y[::2] + 1
    return z.view(-1) * 3


def test_an_intermediate_write_runs_in_place_and_computes_what_eager_does():
    rows, index = torch.randn(4, 3), torch.tensor([0, 2, 2, 5])
    gm = functional(combine, rows, index)
    assert aten.index_put.default in ops(gm)
    copies_before = copies(gm, rows, index)
    assert write_intermediates_in_place(gm) >= 1
    assert aten.index_put_.default in ops(gm) and aten.index_put.default not in ops(gm)
    torch.testing.assert_close(gm(rows, index), combine(rows, index), rtol=0, atol=0)
    assert copies(gm, rows, index) == copies_before - 1  # the out-of-place op's copy of the whole buffer


def copies(gm, *args):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gm(*args)
    return sum(e.name == "aten::copy_" for e in prof.events())


def test_a_write_that_would_change_a_read_values_layout_leaves_the_graph_as_it_was():
    x = torch.randn(4, 6)
    gm = functional(strided_sum, x)
    before = ops(gm)
    assert write_intermediates_in_place(gm) == 0
    assert ops(gm) == before
    torch.testing.assert_close(gm(x), strided_sum(x), rtol=0, atol=0)
    # the guard is what keeps it runnable: torch's pass alone writes the add into the slice
    from torch.fx.passes.reinplace import reinplace

    bare = functional(strided_sum, x)
    reinplace(bare, x)
    bare.recompile()
    assert aten.add_.Tensor in ops(bare)
    try:
        bare(x)
    except RuntimeError as exc:
        assert "view" in str(exc)
    else:
        raise AssertionError("the strided write ran: the guard's case no longer exists")


def test_inputs_and_outputs_are_never_written():
    def f(x, y):
        x2 = x + 1
        return x2, y.mul(2)  # x2 returned, y an input: neither may be written in place

    x, y = torch.randn(3), torch.randn(3)
    gm = functional(f, x, y)
    kept = copy.deepcopy(y)
    write_intermediates_in_place(gm)
    out = gm(x, y)
    torch.testing.assert_close(y, kept, rtol=0, atol=0)
    torch.testing.assert_close(out, f(x, y), rtol=0, atol=0)


def test_a_graph_torchs_pass_fails_on_runs_as_aot_wrote_it():
    """torch.fx's reinplace raises on a graph holding `_assert_async` (what `one_hot` leaves in an MoE router):
    the graph is left whole and still runs."""
    def routed(x, idx):
        torch.ops.aten._assert_async.msg((idx >= 0).all(), "idx must be non-negative")
        out = torch.zeros(6, 3)
        out.index_put_((idx,), x * 2)
        return out.relu()

    x, idx = torch.randn(4, 3), torch.tensor([0, 1, 2, 5])
    gm = functional(routed, x, idx)
    before = ops(gm)
    assert write_intermediates_in_place(gm) == 0
    assert ops(gm) == before
    torch.testing.assert_close(gm(x, idx), routed(x, idx), rtol=0, atol=0)

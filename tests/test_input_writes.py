"""rewrites/input_writes.py: a graph input's functional write (what aot_autograd hands the eager inner compiler:
an op on a view of the input, a scatter rebuilding the input, a copy back at the end) done in place again, where
that keeps the graph's meaning; everything else left as it was. Graphs from torch.func.functionalize + make_fx,
the functional form aot uses; every rewritten graph is run against the eager function."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cgcompile.passes.mutation import mutated_inputs
from cgcompile.rewrites.input_writes import write_inputs_in_place

aten = torch.ops.aten


def functional(fn, *args):
    return make_fx(torch.func.functionalize(fn, remove="mutations"))(*args)


def ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def cache_write_through_slice(cache, pos, k):  # a KV cache's rows of this batch, written at the new position
    cache[:2].index_copy_(1, pos, k)
    return cache[:2].sum(1)


def cache_write_whole(cache, pos, k):  # HF StaticCache's `k_out[:, pos] = key_states`
    cache[:, pos] = k
    return cache * 2


def two_writes(cache, pos, k):  # written twice: the second write reads the first's result
    cache[:2].index_copy_(1, pos, k)
    cache[:2].index_copy_(1, pos + 1, k)
    return cache.sum()


def returns_the_buffer(cache, pos, k):  # the written buffer is an output: in place, it would alias the input
    cache[:, pos] = k
    return cache


def example():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(3, 5, 4, generator=generator), torch.tensor([1]), torch.randn(2, 1, 4, generator=generator)


def k_for(fn):
    cache, pos, k = example()
    whole = fn in (cache_write_whole, returns_the_buffer)  # `cache[:, pos] = k`: every batch row
    return (cache, pos, torch.randn(3, 1, 4, generator=torch.Generator().manual_seed(1)) if whole else k)


@pytest.mark.parametrize("fn, rewritten", [(cache_write_through_slice, 1), (cache_write_whole, 1),
                                           (two_writes, 0), (returns_the_buffer, 0)])
def test_a_write_back_to_an_input_runs_in_place_where_the_meaning_holds(fn, rewritten):
    args = k_for(fn)
    gm = functional(fn, *copy.deepcopy(args))
    before = ops(gm)
    assert aten.copy_.default in before  # the functional form: a copy back into the input at the end
    assert write_inputs_in_place(gm) == rewritten
    after = ops(gm)
    if rewritten:
        assert aten.copy_.default not in after and aten.slice_scatter.default not in after
        assert any(op._schema.is_mutable for op in after)  # the op itself writes the input now
    else:
        assert after == before
    want_args, got_args = copy.deepcopy(args), copy.deepcopy(args)
    want, got = fn(*want_args), gm(*got_args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_args[0], want_args[0], rtol=0, atol=0)  # the buffer as eager left it
    assert 0 in mutated_inputs(gm)  # still known as written (capture undoes its writes; the runtime copies back)


def test_a_read_of_the_old_value_after_the_write_keeps_the_functional_form():
    """A reader of the input placed after the write (the functional graph's order) would see the new rows if the
    write moved there: not rewritten."""
    cache, pos, k = example()
    gm = functional(cache_write_through_slice, cache.clone(), pos, k)
    graph = gm.graph
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    scatter = next(n for n in graph.nodes if n.target is aten.slice_scatter.default)
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(next(n for n in graph.nodes if n.target is aten.copy_.default)):
        old_sum = graph.call_function(aten.sum.default, (placeholder,))  # before the copy back: the old rows
    output.args = ((output.args[0], old_sum),)  # the graph returns the old buffer's sum too
    gm.recompile()
    assert scatter in graph.nodes
    want = gm(cache.clone(), pos, k)
    assert write_inputs_in_place(gm) == 0
    got = gm(cache.clone(), pos, k)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got[1], cache.sum(), rtol=0, atol=0)

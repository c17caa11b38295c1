"""split.single_call: a split graph that is one call of one partition runs as that call alone, with the same
result as the graph's generated forward; any other graph keeps its forward. split.take_in_frame_order: such a
call takes the frame's arguments in the frame's order, so the frame's own argument tuple is passed on."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from cgcompile.split import replace_submodule, single_call, take_in_frame_order


class Pair(torch.nn.Module):
    def forward(self, a, b, c):
        return a * 2 + b, c - a


def split_graph(order, returned):
    """A split graph calling `submod_0` (Pair) with its placeholders in `order`, returning `returned(call)`."""
    graph = fx.Graph()
    placeholders = [graph.placeholder(name) for name in ("x", "y", "z")]
    call = graph.call_module("submod_0", tuple(placeholders[i] for i in order))
    graph.output(returned(graph, call))
    root = torch.nn.Module()
    root.submod_0 = Pair()
    return fx.GraphModule(root, graph)


def items(graph, call):
    return (graph.call_function(operator.getitem, (call, 1)), graph.call_function(operator.getitem, (call, 0)))


def test_one_call_runs_alone_with_the_forwards_result():
    args = [torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for order in ((0, 1, 2), (2, 0, 1)):
        for returned in (lambda graph, call: (call,), items):
            gm = split_graph(order, returned)
            found = single_call(gm)
            assert found is not None and found[1] is False  # a plain module finishes nothing
            direct = found[0]
            want, got = gm.forward(*args), direct(*args)
            assert type(got) is tuple and len(got) == len(want)
            for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
                assert torch.equal(g, w)


def test_any_other_graph_keeps_its_forward():
    def with_glue(graph, call):  # the frame does work of its own after the partition
        return (graph.call_function(operator.add, (graph.call_function(operator.getitem, (call, 0)), 1)),)

    def twice(graph, call):  # the same output handed out twice (an item with two users)
        item = graph.call_function(operator.getitem, (call, 0))
        return (item, item)

    def mixed(graph, call):
        return (call, graph.call_function(operator.getitem, (call, 0)))

    for returned in (with_glue, twice, mixed):
        assert single_call(split_graph((0, 1, 2), returned)) is None

    graph = fx.Graph()  # an argument computed in the frame before the call
    x, y, z = (graph.placeholder(name) for name in ("x", "y", "z"))
    graph.output((graph.call_module("submod_0", (graph.call_function(torch.neg, (x,)), y, z)),))
    root = torch.nn.Module()
    root.submod_0 = Pair()
    assert single_call(fx.GraphModule(root, graph)) is None


class Leaving:
    """A partition that hands its result out as it leaves the frame (as a PartitionRunner does), recording the
    argument tuple it was given."""

    def __init__(self, module):
        self.module, self.given = module, []

    def __call__(self, *args):
        return self.module(*args)

    def leaving(self, args):
        self.given.append(args)
        return (self.module(*args),)


def test_a_frame_that_is_one_call_passes_its_arguments_on_in_its_own_order():
    def frame(x, y, z):  # first use z, y, x: split_module gives the partition's placeholders that order
        return ((z * 2 + y) * x,)

    split_gm = split_module(fx.symbolic_trace(frame), None, lambda node: 0, keep_original_order=True)
    assert [n.name for n in split_gm.submod_0.graph.nodes if n.op == "placeholder"] == ["z", "y", "x"]
    take_in_frame_order(split_gm)
    assert [n.name for n in split_gm.submod_0.graph.nodes if n.op == "placeholder"] == ["x", "y", "z"]
    args = tuple(torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(3))
    assert torch.equal(split_gm(*args)[0], frame(*args)[0])
    partition = Leaving(split_gm.submod_0)
    replace_submodule(split_gm, "submod_0", partition)
    direct, finished = single_call(split_gm, finished=True)
    assert finished
    out = direct(*args)
    assert torch.equal(out[0], frame(*args)[0])
    given, = partition.given  # the frame's arguments as they come (single_call passes its tuple on, no items picked)
    assert len(given) == len(args) and all(g is a for g, a in zip(given, args))

import copy

import pytest
import torch
import torch.nn as nn

import cgcompile
from cgcompile.backend import record_plans
from cgcompile.passes import module_regions
from cgcompile.tagging import is_eager_region


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Inner()
        self.b = Inner()

    def forward(self, x):
        return self.b(self.a(x)) + 1


def regions_seen(model, x):
    """Tags as the backend sees them, from the nn_module_stack of the graph Dynamo hands it."""
    seen = {}

    def backend(gm, example_inputs):
        for node, info in module_regions(gm).items():
            if info.tagged:
                seen[info.tagged[-1][0]] = info.tagged[-1][1]
        return gm.forward

    torch.compile(model, backend=backend)(x)
    return seen


def test_class_decorator_tags_every_instance():
    @cgcompile.tag("mlp")
    class Tagged(Inner):
        pass

    assert cgcompile.tag_of(Tagged()) == "mlp"
    model = Outer()
    model.a = Tagged()
    assert regions_seen(model, torch.randn(2, 4)) == {"a": "mlp"}


def test_instance_tag_keeps_behaviour_state_dict_isinstance_and_survives_deepcopy():
    model = Outer()
    x = torch.randn(2, 4)
    before_out, before_sd = model(x), {k: v.clone() for k, v in model.state_dict().items()}
    cgcompile.tag("attn")(model.b)
    assert isinstance(model.b, Inner) and type(model.b) is not Inner and type(model.a) is Inner
    assert type(model.b).__name__ == "Inner"
    assert torch.equal(model(x), before_out)
    assert model.state_dict().keys() == before_sd.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before_sd.items())
    clone = copy.deepcopy(model)
    assert cgcompile.tag_of(clone.b) == "attn" and cgcompile.tag_of(clone.a) is None
    assert regions_seen(clone, x) == {"b": "attn"}


def test_untag_restores_the_original_class():
    model = Outer()
    cgcompile.tag("attn")(model.a)
    cgcompile.untag(model.a)
    assert type(model.a) is Inner and cgcompile.tag_of(model.a) is None
    assert regions_seen(model, torch.randn(2, 4)) == {}


def test_untag_class():
    @cgcompile.tag("mlp")
    class Tagged(Inner):
        pass

    cgcompile.untag(Tagged)
    assert cgcompile.tag_of(Tagged()) is None


def test_tag_modules_by_pattern_and_error_when_nothing_matches():
    model = nn.Sequential(Outer(), Outer())
    cgcompile.tag_modules(model, {"*.a": "attn", "1.b": "mlp"})
    assert [cgcompile.tag_of(m) for m in (model[0].a, model[1].a, model[0].b, model[1].b)] == \
        ["attn", "attn", None, "mlp"]
    with pytest.raises(cgcompile.ConfigError, match=r"pattern 'layers\.\*\.attn' \(tag 'attn'\) matches no submodule"):
        cgcompile.tag_modules(model, {"layers.*.attn": "attn"})


def test_bad_tag_name():
    with pytest.raises(cgcompile.ConfigError, match="'my tag' is not valid"):
        cgcompile.tag("my tag")


def test_eager_region_on_instance_and_class():
    model = Outer()
    cgcompile.eager_region(model.a)
    assert is_eager_region(model.a) and not is_eager_region(model.b)

    @cgcompile.eager_region
    class Never(Inner):
        pass

    assert is_eager_region(Never())
    # a tag and the eager mark combine on one instance
    cgcompile.tag("attn")(model.a)
    assert is_eager_region(model.a) and cgcompile.tag_of(model.a) == "attn"


def test_eager_region_is_never_captured():
    model = Outer()
    cgcompile.eager_region(model.a)
    with record_plans() as rec:
        torch.compile(model, backend="cudagraph_modules", options={"min_partition_ops": 1})(torch.randn(2, 4))
    (graph,) = rec.graphs
    eager_reasons = [r for p in graph.partitions if not p.captured for r in p.reasons]
    assert any(r.category == "eager_region" and r.module == "a.lin" for r in eager_reasons)
    assert [p.kind for p in graph.partitions] == ["eager", "capture"]
    assert graph.partitions[0].module == "a" and graph.partitions[1].num_ops == 3  # b.lin, relu, + 1


def test_tagging_rejects_non_modules():
    with pytest.raises(TypeError):
        cgcompile.tag("attn")(object())


class BreakingBlock(nn.Module):
    """A module whose forward has a Dynamo graph break in the middle (transformers 5's eager experts loop)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.up(x))
        torch._dynamo.graph_break()
        return self.down(h) * 2


class Host(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.layers = nn.ModuleList([BreakingBlock()])

    def forward(self, x):
        return self.layers[0](self.pre(x)).sum()


def test_tags_and_module_paths_survive_a_graph_break_inside_a_tagged_module():
    """The frames Dynamo compiles after the break (the rest of the method as a resume function, its module
    calls) start at the tagged module: their partitions carry its tag and its path in the model, and the
    selected tag is found (before: "no module in the graph carries that tag")."""
    model = Host()
    cgcompile.tag("blk")(model.layers[0])
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "cuda_graph_modules": ["blk"], "min_partition_ops": 1})
    cgcompile.reset_stats()
    with record_plans() as rec:
        for step in range(5):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            loss, ref = compiled(x), reference(x)
            loss.backward()
            ref.backward()
            torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    (before, _), (after, _) = [(p, plan) for plan in rec.graphs for p in plan.partitions if "mul" in p.nodes
                               or "h" in p.nodes]
    for part in (before, after):  # the resume function's graph holds `self.down(h) * 2`
        assert (part.kind, part.tags, part.module) == ("capture", ("blk",), "layers.0")
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    st = cgcompile.stats()
    assert st["graphs_captured"] >= 2 and st["steady_replays"] > 0 and st["eager_fallbacks"] == []


def test_explain_keeps_module_paths_and_tags_after_a_graph_break():
    """explain() plans the same graphs as the backend: the resume function's partitions carry the module's path
    and tag (before: module "-", and cuda_graph_modules=["blk"] found no module with that tag)."""
    model = Host()
    cgcompile.tag("blk")(model.layers[0])
    plan = cgcompile.explain(model, torch.randn(3, 4),
                             options={"driver": "emulate", "cuda_graph_modules": ["blk"], "min_partition_ops": 1})
    assert len(plan.graphs) >= 2 and plan.graph_breaks
    parts = [p for graph in plan.graphs for p in graph.partitions if "mul" in p.nodes or "h" in p.nodes]
    assert len(parts) == 2
    for part in parts:
        assert (part.kind, part.tags, part.module) == ("capture", ("blk",), "layers.0")


@cgcompile.tag("blk")
class HookedBlock(nn.Module):
    """A tagged block whose methods name their receiver `s`, not `self` (legal, and seen in research code)."""

    def __init__(s):
        super().__init__()
        s.up, s.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(s, x):
        return x + s.down(torch.relu(s.up(x)))


class HookedStack(nn.Module):
    def __init__(s):
        super().__init__()
        s.layers = nn.ModuleList([HookedBlock() for _ in range(2)])
        s.head = nn.Linear(4, 2)

    def forward(s, x):
        for layer in s.layers:
            x = layer(x)
        return s.head(x).square().mean()


def test_tagged_blocks_with_full_backward_hooks_are_frames_of_their_own_and_keep_their_tags():
    """A full backward hook on a module (a gradient logger) makes Dynamo run the module's call eagerly and compile
    its forward as a frame of its own: the frame's root is the block, found by its receiver (here `s`: before, only
    a receiver named `self` was, and the blocks ran untagged, nothing captured, nothing said). Captured and
    replayed; the loss, the grads and what each hook saw are eager's."""
    torch.manual_seed(0)
    model = HookedStack()
    reference = copy.deepcopy(model)
    seen = {id(model): [], id(reference): []}
    for m in (model, reference):
        for layer in m.layers:
            layer.register_full_backward_hook(lambda mod, gin, gout, log=seen[id(m)]: log.append(gout[0].clone()))
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "cuda_graph_modules": ["blk"], "min_partition_ops": 1,
                                      "cuda_graph_warmup_steps": 1})
    cgcompile.reset_stats()
    with record_plans() as rec:
        for step in range(6):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            for m in (model, reference):
                m.zero_grad(set_to_none=True)
            loss, ref = compiled(x), reference(x)
            loss.backward()
            ref.backward()
            torch.testing.assert_close(loss, ref, rtol=0, atol=0)
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert len(seen[id(model)]) == len(seen[id(reference)]) == 12
    for got, want in zip(seen[id(model)], seen[id(reference)]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    blocks = {(p.module, p.kind, p.tags) for plan in rec.graphs for p in plan.partitions if p.tags}
    assert blocks >= {("layers.0", "capture", ("blk",)), ("layers.1", "capture", ("blk",))}, blocks
    before = cgcompile.stats()["steady_replays"]
    model.zero_grad(set_to_none=True)
    compiled(torch.randn(3, 4)).backward()
    assert cgcompile.stats()["steady_replays"] - before == 4  # both blocks' forward and backward replayed

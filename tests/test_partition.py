"""Region rules of the partition plan (planner.py) on small tagged models and the model zoo."""

import pytest
import torch
import torch.nn as nn

import cgcompile
from cgcompile.planner import layer_of, common_module
from tests.models import MODELS, moe


class Norm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@cgcompile.tag("attn")
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x)) * 2


@cgcompile.tag("mlp")
class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.up(x)) + 1


class Layer(nn.Module):
    def __init__(self, sync=False):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = Norm(), Attn(), Norm(), Mlp()
        self.sync = sync

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        if self.sync:
            x = x + x[torch.nonzero(x[:, 0] > 0).squeeze(1)].sum()  # SYNC
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self, n=2, sync=False):
        super().__init__()
        self.layers = nn.ModuleList(Layer(sync) for _ in range(n))
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def plan(model, options, x=None, **flags):
    x = torch.randn(4, 8) if x is None else x
    with torch._dynamo.config.patch(**flags):
        return cgcompile.explain(model, x, options=options)


def summary(graph):
    return [(p.kind, "+".join(p.tags), p.module) for p in graph.partitions]


def test_selected_modules_merge_per_layer_with_glue():
    (graph,) = plan(Net(), {"cuda_graph_modules": ["attn", "mlp"]}).graphs
    assert summary(graph) == [("capture", "attn+mlp", "layers.0"), ("capture", "attn+mlp", "layers.1"),
                              ("eager", "", "head")]
    assert graph.partitions[2].reasons[0].category == "untagged"


def test_strict_modules_keeps_one_partition_per_tagged_instance_and_no_glue():
    (graph,) = plan(Net(), {"cuda_graph_modules": ["attn", "mlp"], "strict_modules": True}).graphs
    captured = [(p.tag, p.module) for p in graph.captured]
    assert captured == [("attn", "layers.0.attn"), ("mlp", "layers.0.mlp"),
                        ("attn", "layers.1.attn"), ("mlp", "layers.1.mlp")]
    assert all(p.kind == "eager" for p in graph.partitions if p.tag is None)


def test_unselected_tag_stays_eager_with_reason():
    (graph,) = plan(Net(), {"cuda_graph_modules": ["attn"]}).graphs
    assert [p.module for p in graph.captured] == ["layers.0", "layers.1"]
    assert all(p.tags == ("attn",) for p in graph.captured)
    reasons = [r for p in graph.partitions for r in p.reasons]
    assert any(r.category == "not_selected" and "'mlp'" in r.hint for r in reasons)


def test_whole_layer_captures_every_capture_safe_span_cut_at_layers():
    (graph,) = plan(Net(), {"cuda_graph_modules": []}).graphs
    # the head (one linear, below min_partition_ops=2) joins the last layer's graph instead of staying eager
    assert summary(graph) == [("capture", "attn+mlp", "layers.0"), ("capture", "attn+mlp", None)]
    assert graph.partitions[1].nodes[-1] == "linear_4"  # the head's linear


def test_whole_layer_cuts_just_before_the_next_layers_first_matmul():
    """Layer 1's input norm runs in layer 0's graph (where Inductor fuses it with the residual add that makes its
    input); the cut sits at the first linear, an extern kernel that reads its input from memory either way. The
    partition keeps its layer's name."""
    model = nn.Sequential(Layer(), Layer(), Layer())
    (graph,) = plan(model, {"cuda_graph_modules": []}).graphs
    assert summary(graph) == [("capture", "attn+mlp", "0"), ("capture", "attn+mlp", "1"),
                              ("capture", "attn+mlp", "2")]
    gm = torch.fx.symbolic_trace(model)  # the same ops in the same order as Dynamo's graph
    firsts = [p.nodes[0] for p in graph.partitions[1:]]
    assert all(name.startswith("linear") for name in firsts), firsts
    assert [p.nodes[-1].startswith(("mul", "rsqrt")) for p in graph.partitions[:2]] == [True, True], \
        [p.nodes[-3:] for p in graph.partitions]
    assert sum(p.num_ops for p in graph.partitions) == sum(
        n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes)


def test_whole_layer_cut_stays_at_the_layer_when_moving_it_would_leave_too_few_ops():
    class Tail(nn.Module):  # a norm, then one linear: moved, the linear alone is below min_partition_ops
        def __init__(self):
            super().__init__()
            self.norm, self.out = Norm(), nn.Linear(8, 8)

        def forward(self, x):
            return self.out(self.norm(x))

    (graph,) = plan(nn.Sequential(Layer(), Tail()), {"cuda_graph_modules": []}).graphs
    assert summary(graph) == [("capture", "attn+mlp", "0"), ("capture", "", "1")]
    assert graph.partitions[1].num_ops == 6  # the norm's 5 ops and the linear


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),  # each child a 1-op "layer"
    nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.GELU()), nn.Sequential(nn.Linear(16, 8))),  # untagged containers
], ids=["flat", "nested"])
def test_whole_layer_merges_small_layers_before_the_size_rule(model):
    (graph,) = plan(model, {"cuda_graph_modules": []}).graphs
    assert summary(graph) == [("capture", "", None)]
    assert graph.partitions[0].num_ops == 3


def test_whole_layer_keeps_layers_that_are_big_enough_apart():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(3)])
    (graph,) = plan(model, {"cuda_graph_modules": []}).graphs
    assert summary(graph) == [("capture", "", "0"), ("capture", "", "1"), ("capture", "", "2")]


def test_whole_layer_size_rule_applies_to_the_merged_run():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    (graph,) = plan(model, {"cuda_graph_modules": [], "min_partition_ops": 4}).graphs
    assert graph.captured == [] and graph.partitions[0].reasons[0].category == "too_small"


def test_block_scope_ignores_module_boundaries():
    with torch.no_grad():
        (graph,) = plan(Net(), {"cuda_graph_modules": ["attn"], "inference_cuda_graph_scope": "block"}).graphs
    assert graph.scope == "block" and not graph.training
    assert summary(graph) == [("capture", "attn+mlp", None)]


def test_inference_layer_scope_uses_module_regions():
    with torch.no_grad():
        (graph,) = plan(Net(), {"cuda_graph_modules": ["attn"]}).graphs
    assert graph.scope == "layer" and [p.module for p in graph.captured] == ["layers.0", "layers.1"]


def test_min_partition_ops_leaves_small_runs_eager():
    (graph,) = plan(Net(), {"cuda_graph_modules": ["attn", "mlp"], "strict_modules": True,
                            "min_partition_ops": 4}).graphs
    assert graph.captured == []
    small = [r for p in graph.partitions for r in p.reasons if r.category == "too_small"]
    assert small and "min_partition_ops=4" in small[0].detail


def test_eager_island_splits_the_layer_and_names_the_line():
    (graph,) = plan(Net(sync=True), {"cuda_graph_modules": []}, capture_dynamic_output_shape_ops=True).graphs
    kinds = [p.kind for p in graph.partitions]
    assert kinds[:3] == ["capture", "eager", "capture"]
    reason = graph.partitions[1].reasons[0]
    assert reason.category == "dynamic_shape" and reason.op == "torch.nonzero"
    assert reason.location.endswith(f"test_partition.py:{Layer.forward.__code__.co_firstlineno + 3}")


def test_selected_region_with_unsafe_op_is_eager_as_a_whole_or_raises_with_strict():
    class Sync(nn.Module):
        def forward(self, x):
            return x[torch.nonzero(x[:, 0] > 0).squeeze(1)].sum(0) + x.mean(0)

    model = Net()
    cgcompile.tag("moe")(model.layers[0].mlp)  # instance tag overrides the class's "mlp"
    model.layers[0].mlp.sync = Sync()
    model.layers[0].mlp.forward = lambda x, m=model.layers[0].mlp: Mlp.forward(m, x) + m.sync(x)
    opts = {"cuda_graph_modules": ["moe", "attn"]}
    (graph,) = plan(model, opts, capture_dynamic_output_shape_ops=True).graphs
    moe_parts = [p for p in graph.partitions if "moe" in p.tags]
    assert moe_parts and all(p.kind == "eager" for p in moe_parts)
    assert any(r.op == "torch.nonzero" for p in moe_parts for r in p.reasons)
    with pytest.raises(cgcompile.ConfigError, match=r"strict=True.*\n.*layers\.0\.mlp: dynamic_shape torch\.nonzero"):
        plan(model, {**opts, "strict": True}, capture_dynamic_output_shape_ops=True)


def test_selected_name_absent_from_the_graph_raises_with_did_you_mean():
    model = Net()
    cgcompile.tag("feedforward")(model.layers[1].mlp)
    with pytest.raises(cgcompile.ConfigError) as info:
        plan(model, {"cuda_graph_modules": ["fedforward"]})
    msg = str(info.value)
    assert "'fedforward' (did you mean 'feedforward'?)" in msg and "tags present: attn, feedforward, mlp" in msg


class Untagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = self.up(x)
        torch._dynamo.graph_break()  # the rest is a frame of its own: a fragment may hold no tag
        return self.down(torch.relu(x))


def test_selection_over_a_model_that_carries_no_tag_raises_at_its_first_call():
    """With no tag anywhere in the model, the selection can match nothing: the first call says so, whichever
    graph of the frame it is. A compiled function running no module may be a loss with no module at all: not
    an error, it runs eagerly."""
    options = {"driver": "emulate", "cuda_graph_modules": ["attn"]}
    compiled = torch.compile(Untagged(), backend="cudagraph_modules", options=options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(torch.randn(4, 8))
    assert "cuda_graph_modules selects 'attn', but no module in the graph carries that tag; tags present: none. " \
           "Tag the module with @cgcompile.tag(...)" in str(info.value)
    loss = torch.compile(lambda a, b: (a - b).pow(2).mean(), backend="cudagraph_modules", options=options)
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(loss(a, b), (a - b).pow(2).mean())


def test_impl_none_plans_everything_eager_and_shows_what_local_would_capture():
    (graph,) = plan(Net(), {"cuda_graph_impl": "none", "cuda_graph_modules": ["attn"]}).graphs
    (local,) = plan(Net(), {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn"]}).graphs
    assert [p.kind for p in graph.partitions] == ["eager"] * len(local.partitions)
    assert [p.nodes for p in graph.partitions] == [p.nodes for p in local.partitions]
    for mine, theirs in zip(graph.partitions, local.partitions):
        if theirs.captured:
            assert [(r.category, r.detail) for r in mine.reasons] == [
                ("disabled", "would be captured; cuda_graph_impl is 'none'")]
            assert mine.module == theirs.module
        else:
            assert mine.reasons == theirs.reasons
    assert any(p.captured for p in local.partitions) and not all(p.captured for p in local.partitions)


def test_no_grad_graph_is_not_captured_without_inference_scope():
    with torch.no_grad():
        (graph,) = plan(Net(), {"cuda_graph_impl": "transformer_engine"}).graphs
    assert graph.captured == [] and "inference_cuda_graph_scope" in graph.partitions[0].reasons[0].detail


def test_layer_and_common_module_helpers():
    assert layer_of("layers.3.attn.q") == "layers.3" and layer_of("head") is None and layer_of(None) is None
    assert common_module(["layers.0.attn", "layers.0.moe.router"]) == "layers.0"
    assert common_module(["layers.0", None]) is None


@pytest.mark.parametrize("name", ["moe_mask", "moe_sort"])
def test_moe_plans_capture_router_and_preprocess_per_layer_never_an_expert(name):
    spec = MODELS[name]
    model = spec.make(num_layers=2)
    (tokens,) = spec.example_inputs()
    p = plan(model, spec.options(), tokens, **spec.dynamo_flags())
    captured = [part for g in p.graphs for part in g.captured]
    assert all("expert" not in (part.module or "") for part in captured)
    for part in captured:
        assert not {"moe"} & set(part.tags)
    tags = [tag for part in captured for tag in part.tags]
    # mask dispatch traces as one graph (both layers); sort dispatch breaks the graph and Dynamo reuses the
    # layer's graphs for the second layer, so explain sees each region once
    expected_count = 2 if spec.dispatch == "mask" else 1
    for tag in ("attn", "moe_router", "moe_preprocess"):
        assert tags.count(tag) == expected_count, (tag, str(p))
    cited = {r.location for g in p.graphs for part in g.partitions for r in part.reasons}
    cited |= {b.location for b in p.graph_breaks}
    expected = {f"{moe.SOURCE_FILE}:{line}" for line in moe.dispatch_lines(spec.dispatch)}
    assert expected & cited, (expected, cited)


def test_moe_sort_with_preprocess_counts_names_the_tolist_line():
    model = moe.build(num_layers=1, dispatch="sort", sort_counts="preprocess")
    (tokens,) = moe.example_inputs()
    p = plan(model, MODELS["moe_sort"].options(), tokens)
    (tolist_line,) = moe.dispatch_lines("sort", kinds=("tolist",))
    cited = {b.location for b in p.graph_breaks}
    assert f"{moe.SOURCE_FILE}:{tolist_line}" in cited, str(p)

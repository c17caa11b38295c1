"""The collectives pass on graphs Dynamo builds from torch.distributed calls, in one process: a 1-rank gloo group
(FileStore, no network), so these run in CI as fast as the other pass tests.

Fixed-shape collectives (c10d in-place calls that Dynamo remaps, functional collectives) are capturable;
split sizes that depend on tensor data (a traced `.tolist()`, or symbolic ints after a graph break) are eager,
with the collective's own line and, in the detail, the line the sizes came from.
"""

import inspect
import os

import pytest
import torch
import torch.distributed as dist

from cgcompile.backend import cudagraph_modules, record_plans
from cgcompile.config import CudaGraphConfig
from cgcompile.planner import plan_graph
from cgcompile.passes import analyze
from cgcompile.passes.collectives import collective_counts, find_data_dependent_collectives, is_collective
from cgcompile.passes.common import node_location
from cgcompile.passes.common import op_key, op_name

try:
    from tests.models import ep_moe
except ModuleNotFoundError:  # tests/ itself on sys.path
    from models import ep_moe

if dist.is_available():
    import torch.distributed._functional_collectives as funcol

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

HERE = os.path.abspath(__file__)
A2A = "_c10d_functional.all_to_all_single"
# the autograd-aware token all-to-all traces to this op on torch 2.11 and to A2A on 2.13
A2A_OPS = {A2A, "_c10d_functional_autograd.all_to_all_single"}
WAIT = "_c10d_functional.wait_tensor"


@pytest.fixture(scope="module", autouse=True)
def group(tmp_path_factory):
    """A 1-rank gloo process group for the module (reused if the process already has one)."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def graphs_of(fn, *calls, dynamic=None, **flags):
    """The FX graphs Dynamo hands a backend while fn(*args) runs for each args tuple in `calls`."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    with torch._dynamo.config.patch(**flags):
        for args in calls:
            compiled(*args)
    return graphs


def line_of(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    return f"{HERE}:{start + next(i for i, text in enumerate(lines) if marker in text)}"


def nodes_of(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n) == name]


def whole_layer_plan(gm):
    return plan_graph(gm, CudaGraphConfig.from_options({"cuda_graph_impl": "local"}))


def kind_of(graph_plan, node):
    return next(p.kind for p in graph_plan.partitions if node.name in p.nodes)


def test_functional_collective_packets_are_collectives():
    """Dynamo records the functional ops as OpOverloadPackets, which have no `.namespace` attribute."""
    def fn(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    (gm,) = graphs_of(fn, (torch.randn(4),))
    names = {op_name(n) for n in gm.graph.nodes if n.op == "call_function" and is_collective(n)}
    assert names == {"_c10d_functional.all_reduce", WAIT}
    assert not any(is_collective(n) for n in gm.graph.nodes if n.op == "call_function" and "mul" in op_name(n))


def test_an_in_place_collective_counts_as_its_collective():
    """torch 2.11's aot graphs hold `all_reduce_` where 2.13's hold `all_reduce`: stats() counts both as all_reduce."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for op in (torch.ops._c10d_functional.all_reduce_.default, torch.ops._c10d_functional.all_reduce.default):
        reduced = graph.call_function(op, (x, "sum", "0"))
        graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    graph.output(x)
    assert collective_counts(torch.fx.GraphModule(torch.nn.Module(), graph)) == {"all_reduce": 2}


def test_dynamo_s_own_dtensor_wrappers_read_as_the_calls_they_stand_for():
    """torch 2.11's Dynamo records x.redistribute(...) and DTensor.from_local(...) as functions of its own named
    "prim_redistribute" and "prim from_local": the planner's rules and the plan's names see the calls."""
    def wrapper(name):
        def fn(x):
            return x
        fn.__name__, fn.__module__ = name, "torch._dynamo.variables.tensor"
        return fn

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_function(wrapper(name), (x,)) for name in ("prim_redistribute", "prim from_local")]
    own = graph.call_function(wrapper("prim_helper"), (x,))
    own.target.__module__ = __name__  # not Dynamo's: its own name
    graph.output(x)
    assert [(op_key(n), op_name(n)) for n in nodes] == [("redistribute", "Tensor.redistribute"),
                                                        ("from_local", "DTensor.from_local")]
    assert (op_key(own), op_name(own)) == ("prim_helper", f"{__name__}.prim_helper")


def test_fixed_all_reduce_and_equal_all_to_all_are_captured():
    def fn(x, counts):
        y = x * 2
        dist.all_reduce(y)  # c10d in-place, remapped to a functional collective
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)  # equal splits: fixed shape
        z = funcol.all_to_all_single(y, [4], [4], dist.group.WORLD)  # constant splits
        return z + received.sum()

    (gm,) = graphs_of(fn, (torch.randn(4, 3), torch.tensor([4])))
    assert find_data_dependent_collectives(gm) == {}
    assert not any(is_collective(n) for n in analyze(gm))
    graph_plan = whole_layer_plan(gm)
    collectives = [n for n in gm.graph.nodes if n.op == "call_function" and is_collective(n)]
    assert len(collectives) == 6
    assert all(kind_of(graph_plan, n) == "capture" for n in collectives)


def test_all_to_all_with_tolist_splits_is_eager_naming_both_lines():
    def fn(x, counts):
        splits = counts.tolist()  # TOLIST
        y = funcol.all_to_all_single(x, splits, splits, dist.group.WORLD)  # A2A
        return y * 2

    (gm,) = graphs_of(fn, (torch.randn(4, 3), torch.tensor([4])), capture_scalar_outputs=True)
    found = find_data_dependent_collectives(gm)
    (a2a,) = nodes_of(gm, A2A)
    (wait,) = nodes_of(gm, WAIT)
    assert set(found) == {a2a, wait}
    (f,) = found[a2a]
    assert (f.category, f.op, f.location) == ("collective", A2A, line_of(fn, "# A2A"))
    assert os.path.basename(line_of(fn, "# TOLIST")) in f.detail and "drop-and-pad" in f.hint
    (w,) = found[wait]
    assert (w.category, w.location) == ("collective", line_of(fn, "# A2A")) and a2a.name in w.detail
    # the passes together: the collective's own finding comes first
    assert analyze(gm)[a2a][0].category == "collective"
    graph_plan = whole_layer_plan(gm)
    assert kind_of(graph_plan, a2a) == kind_of(graph_plan, wait) == "eager"


def test_c10d_all_to_all_with_data_dependent_output_names_the_user_call():
    """The in-place c10d call is remapped (all_to_all_inplace -> functional op -> copy_); the finding points at
    the user's dist.all_to_all_single line, not at torch/distributed internals."""
    def fn(x, counts):
        splits = counts.tolist()
        out = x.new_empty(sum(splits), x.shape[1])
        dist.all_to_all_single(out, x, splits, splits)  # C10D
        return out * 2

    (gm,) = graphs_of(fn, (torch.randn(4, 3), torch.tensor([4])), capture_scalar_outputs=True)
    (a2a,) = nodes_of(gm, A2A)
    assert node_location(a2a) == line_of(fn, "# C10D")
    assert find_data_dependent_collectives(gm)[a2a][0].location == line_of(fn, "# C10D")


def test_split_sizes_passed_as_ints_are_eager_once_symbolic():
    """Default flags: a .tolist() breaks the graph and the next graph gets the sizes as Python ints. Its first
    compile specializes them (constants: fixed); after they change Dynamo recompiles with symbolic ints, and
    the collective is left eager instead of getting one graph per combination."""
    def fn(x, splits):
        return funcol.all_to_all_single(x, splits, splits, dist.group.WORLD) * 2  # INTS

    first, second = graphs_of(fn, (torch.randn(3, 2), [3]), (torch.randn(5, 2), [5]), (torch.randn(6, 2), [6]))
    assert find_data_dependent_collectives(first) == {}
    found = find_data_dependent_collectives(second)
    (a2a,) = nodes_of(second, A2A)
    assert set(found) == {a2a, *nodes_of(second, WAIT)}
    assert found[a2a][0].location == line_of(fn, "# INTS")
    assert "symbolic Python ints" in found[a2a][0].detail and "capture_scalar_outputs" in found[a2a][0].hint


def test_splits_from_dynamic_tensor_shapes_stay_capturable():
    """dynamic=True: equal splits of a dynamic batch are backed sizes of a tensor input (graph bank per size)."""
    def fn(x):
        return funcol.all_to_all_single(x, None, None, dist.group.WORLD) * 2

    (gm,) = graphs_of(fn, (torch.randn(3, 2),), dynamic=True)
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes
               if n.op == "placeholder"), "expected Dynamo to lift the batch size as a SymInt input"
    assert find_data_dependent_collectives(gm) == {}


def test_non_collective_nodes_are_ignored():
    def fn(x):
        return torch.nonzero(x).sum()

    (gm,) = graphs_of(fn, (torch.tensor([0.0, 1.0, 2.0]),), capture_dynamic_output_shape_ops=True)
    assert find_data_dependent_collectives(gm) == {}
    assert not any(is_collective(n) for n in gm.graph.nodes)


# ---- the EP model on one rank ---------------------------------------------------------------------------

OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": list(ep_moe.CUDA_GRAPH_MODULES)}


def _ep_lines(kind):
    return {f"{ep_moe.SOURCE_FILE}:{n}" for n in ep_moe.ep_lines(kind)}


def test_ep_model_one_rank_plan_and_parity(group):
    """The EP layer on a 1-rank group: the same collectives as on many ranks, checked in-process."""
    eager, model = ep_moe.build(group=group), ep_moe.build(group=group)
    gms = []

    def backend(gm, example_inputs):
        gms.append(gm)
        return cudagraph_modules(gm, example_inputs, options=OPTIONS)

    compiled = torch.compile(model, backend=backend)
    (tokens,) = ep_moe.example_inputs()
    with torch._dynamo.config.patch(capture_scalar_outputs=True), record_plans() as rec:
        out = ep_moe.loss(compiled, tokens)
        out.backward()
    ref = ep_moe.loss(eager, tokens)
    ref.backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)

    (gm,), (graph_plan,) = gms, rec.graphs
    placed = {(op_name(n), node_location(n)): kind_of(graph_plan, n)
              for n in gm.graph.nodes if n.op == "call_function" and is_collective(n)}
    (reduce_line,), (counts_line,) = _ep_lines("all_reduce"), _ep_lines("counts_a2a")
    assert placed[("_c10d_functional.all_reduce", reduce_line)] == "capture"
    assert placed[(A2A, counts_line)] == "capture"
    token_a2a = {line: kind for (op, line), kind in placed.items() if op in A2A_OPS and line in _ep_lines("a2a")}
    assert token_a2a == dict.fromkeys(_ep_lines("a2a"), "eager")
    captured = {t for p in graph_plan.partitions if p.captured for t in p.tags}
    assert {"attn", "moe_router", "moe_preprocess"} <= captured
    reasons = [r for p in graph_plan.partitions if not p.captured for r in p.reasons]
    assert {r.location for r in reasons if r.category == "collective" and r.op in A2A_OPS} == _ep_lines("a2a")
    assert {r.location for r in reasons if r.category == "host_sync"} == _ep_lines("sync")


def test_ep_model_without_group_matches_the_layer_with_all_experts_local():
    """group=None: no collectives, every expert local; the math the EP group must reproduce."""
    model = ep_moe.build(group=None, num_local_experts=4)
    (tokens,) = ep_moe.example_inputs()
    logits, aux = model(tokens)
    assert logits.shape == (2, 8, ep_moe.VOCAB) and aux.ndim == 0 and torch.isfinite(aux)
    # per token: sum_k w_k * expert_{id_k}(x), computed directly
    layer = model.layers[0]
    x = model.embed(tokens)
    x = x + layer.attn(layer.attn_norm(x))
    h = layer.moe_norm(x).reshape(-1, x.shape[-1])
    weights, ids, _ = layer.moe.router(h)
    direct = torch.stack([sum(weights[t, k] * layer.moe.local_experts[int(ids[t, k])](h[t:t + 1])[0]
                              for k in range(ids.shape[1])) for t in range(h.shape[0])])
    moe_out, _ = layer.moe(layer.moe_norm(x))
    torch.testing.assert_close(moe_out.reshape(-1, x.shape[-1]), direct, rtol=1e-5, atol=1e-6)


def test_c10d_inplace_all_to_all_gains_autograd_when_compiled():
    """Why ep_moe uses functional collectives for tokens (checked on torch 2.13): the eager c10d call does not
    record autograd (its output needs no grad), the Dynamo-remapped functional op does. Same code, different
    gradients; the documented reason to keep c10d in-place calls for tensors that need no gradient."""
    def fn(z):
        out = torch.empty_like(z)
        dist.all_to_all_single(out, z)
        return out

    x = torch.randn(4, requires_grad=True)
    assert not fn(x * 3).requires_grad
    assert torch.compile(fn, backend="eager")(x * 3).requires_grad

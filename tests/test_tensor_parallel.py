"""Tensor parallelism (DTensor, `parallelize_module`) through cudagraph_modules, on CPU ranks (gloo, emulate driver).

Two spawned runs, each a worker script that is this file (tests/spawn.py):
- 2 ranks, one TP mesh: the TP GPT of tests/models/tp_gpt.py with q/k/v and MLP-up column-wise, o and MLP-down
  row-wise (`tp`); the same with sequence parallel norms (`sp`); TP x EP, attention tensor-parallel and the MLPs
  the expert-parallel MoE over the same ranks, on sequence shards (`tp_ep`); a compiled module returning a DTensor
  that lives in graph memory; the plan of a redistribution whose rows come from data.
- 4 ranks, a 2x2 mesh: FSDP2 over "dp" (reshard_after_forward=False) around the TP model over "tp", SGD.
Each compiled model trains next to the same eager model (new tokens every step); the tests compare losses and local
gradients on every rank, check that the captured graphs replay after warmup with no re-capture, and read the
collectives each captured graph runs.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

try:
    from tests import tp_steps
    from tests.spawn import run_ranks, serve
except ModuleNotFoundError:  # tests/ itself on sys.path
    import tp_steps
    from spawn import run_ranks, serve

TIMEOUT_S = 240
RUNS_2 = ("tp", "sp", "tp_ep")

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"),
]


# ---- worker (runs in the spawned processes) -------------------------------------------------------------

def _dtensor_output(mesh):
    """A compiled block whose output is a DTensor in graph memory (RowwiseParallel(use_local_output=False)): every
    output held across later replays must keep its value."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tests.models._common import seeded

    tp_steps.fresh()
    with seeded(0):
        block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=False)})
    compiled = torch.compile(block, backend="cudagraph_modules", options=tp_steps.options("emulate"))
    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        outputs = [compiled(x) for x in inputs]  # warmup, capture, replay, replay
        expected = [block(x) for x in inputs]
    return {"type": type(outputs[-1]).__name__, "replays": tp_steps.counters()["replays"],
            "max_diff": max((o.full_tensor() - e.full_tensor()).abs().max().item()
                            for o, e in zip(outputs, expected))}


def _data_dependent_plan(mesh):
    """explain() of a redistribution of rows selected by a mask: its all_gather is eager, named as a collective."""
    import cgcompile
    from torch.distributed.tensor import DTensor, Replicate, Shard

    class Gather(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            rows = DTensor.from_local(self.lin(x[x[:, 0] > 0]), mesh, [Shard(0)], run_check=False)
            return rows.redistribute(mesh, [Replicate()]).to_local().sum() + self.lin(x).sum()  # GATHER

    tp_steps.fresh()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))  # the same rows on every rank
        plan = cgcompile.explain(Gather(), x, options=tp_steps.options("emulate"))
    source = inspect.getsourcelines(Gather.forward)
    marker = source[1] + next(i for i, text in enumerate(source[0]) if "# GATHER" in text)
    return [{"reason": f"{r.category}: {r.op}: {r.detail}\nhint: {r.hint}", "line": r.location.endswith(f":{marker}")}
            for g in plan.graphs for p in g.partitions if not p.captured for r in p.reasons
            if r.category == "collective"]


def _fsdp_tp_run(rank):
    """FSDP2 over "dp" around the TP model over "tp" on a 2x2 mesh, SGD on both copies; each dp rank its own tokens."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.models import tp_gpt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def sharded():
        model = tp_gpt.parallelize(tp_gpt.build(), mesh["tp"])
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
        return fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)

    tp_steps.fresh()
    eager, model = sharded(), sharded()
    compiled = torch.compile(model, backend="cudagraph_modules", options=tp_steps.options("emulate", "attn", "mlp"))
    opts = [torch.optim.SGD(m.parameters(), lr=tp_steps.LR) for m in (eager, model)]
    dp = mesh["dp"].get_local_rank()
    batches = [tp_gpt.example_inputs(seed=10 * step + dp)[0] for step in range(tp_steps.STEPS)]
    result = tp_steps.train(eager, model, compiled, batches, tp_gpt.loss, opts)
    result["param_diff"] = max((p.to_local() - q.to_local()).abs().max().item()
                               for p, q in zip(eager.parameters(), model.parameters()))
    result["q_shard"] = list(tp_steps.local(model.layers[0].attn.q.weight).shape)
    return result


def work(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    if world == 2:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        result = {"tp": tp_steps.tp_run(mesh, False), "sp": tp_steps.tp_run(mesh, True),
                  "tp_ep": tp_steps.tp_ep_run(mesh), "dtensor_output": _dtensor_output(mesh),
                  "data_dependent": _data_dependent_plan(mesh)}
    else:
        result = {"fsdp_tp": _fsdp_tp_run(rank)}
    import cgcompile
    cgcompile.release()
    return result


# ---- tests (run in pytest) -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(__file__, tmp_path_factory.mktemp("tp2"), 2, TIMEOUT_S, "TP")


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks(__file__, tmp_path_factory.mktemp("tp4"), 4, TIMEOUT_S, "FSDP2 x TP")


def _all_runs(two, four):
    return [(f"rank {r} {name}", two[r][name]) for r in range(2) for name in RUNS_2] + \
        [(f"rank {r} fsdp_tp", four[r]["fsdp_tp"]) for r in range(4)]


def test_compiled_tp_trains_exactly_like_eager_tp(two, four):
    """Every rank, every run: the same loss and the same local gradients as the eager TP model, every step; every
    parameter gets a gradient; with FSDP2 the parameter shards after SGD are the same too."""
    for name, run in _all_runs(two, four):
        for step in run["steps"]:
            assert step["loss_diff"] == step["grad_diff"] == 0.0 and not step["missing_grads"], (name, run["steps"])
        assert len({s["loss"] for s in run["steps"]}) == tp_steps.STEPS, (name, "new tokens every step")
        assert not run["end"]["eager_fallbacks"] and not run["end"]["bank_stops"], (name, run["end"])
    assert all(four[r]["fsdp_tp"]["param_diff"] == 0.0 for r in range(4))


def test_the_models_are_sharded_and_compute_the_unsharded_function(two, four):
    """The TP math is right (eager TP = the unsharded model, up to float32 summation order), and the weights are
    really sharded: q's local shard holds half the output features (and half the rows again under FSDP2)."""
    for r in range(2):
        for name in ("tp", "sp"):
            assert two[r][name]["unsharded_loss_diff"] < 1e-5, two[r][name]["unsharded_loss_diff"]
            assert two[r][name]["q_shard"] == [16, 32]
    assert all(four[r]["fsdp_tp"]["q_shard"] == [8, 32] for r in range(4))


def test_graphs_are_captured_and_reused_without_recapture(two, four):
    """Captured in warmup, then replayed on every later step: each partition's replays grow after warmup, no graph
    is captured again, and every captured graph has run again after its capture."""
    for name, run in _all_runs(two, four):
        warm, end = run["warm"], run["end"]
        assert end["recaptures"] == warm["recaptures"] == 0, (name, warm, end)
        assert end["graphs_captured"] == warm["graphs_captured"] > 0, (name, warm, end)
        for partition, row in end["partitions"].items():
            assert row["captures"] == warm["partitions"][partition]["captures"], (name, partition)
            assert row["replays"] >= warm["partitions"][partition]["replays"] + tp_steps.STEPS - tp_steps.WARMUP_STEPS, \
                (name, partition, warm["partitions"], end["partitions"])
        # FSDP2 (without TP too): one compiled frame serves both layers and warms up per frame, so layer 1 captures
        # first (step 1), layer 0 in step 2; the shared-pool rule keeps that first graph from replaying while layer
        # 0's later-captured graph is busy, so layer 1 takes a second instance: the first one never replays
        first_fsdp = ["#1 " in g["label"] for g in end["graphs"]] if "fsdp" in name else [False] * len(end["graphs"])
        assert all(g["replays"] > 1 or first for g, first in zip(end["graphs"], first_fsdp)), (name, end["graphs"])


def _collectives(run, kind):
    """The collectives of each `kind` graph replayed after its capture (steady state)."""
    return sorted(sorted(g["collectives"].items()) for g in run["end"]["graphs"]
                  if g["kind"] == kind and g["replays"] > 1)


def test_collectives_dtensor_inserts_are_inside_the_captured_graphs(two, four):
    """The collectives each captured graph runs (from its aot graph): the row-wise all_reduces in the forward, the
    column-wise inputs' gradient all_reduces in the backward; with sequence parallel, all_gather and reduce_scatter
    both ways (the last block also gathers the sequence back). FSDP2's own collectives run outside the graphs."""
    for r in range(2):
        tp, sp = two[r]["tp"], two[r]["sp"]
        assert _collectives(tp, "forward") == [[("all_reduce", 2)]] * 2
        assert _collectives(tp, "backward") == [[("all_reduce", 4)]] * 2
        assert _collectives(sp, "forward") == [[("all_gather_into_tensor", 2), ("reduce_scatter_tensor", 2)],
                                               [("all_gather_into_tensor", 3), ("reduce_scatter_tensor", 2)]]
        assert _collectives(sp, "backward") == _collectives(sp, "forward")
    for r in range(4):
        fsdp_tp = four[r]["fsdp_tp"]
        assert _collectives(fsdp_tp, "forward") == [[("all_reduce", 2)]] * 2
        assert _collectives(fsdp_tp, "backward") == [[("all_reduce", 4)]] * 2


def test_plan_shows_each_redistribution_and_where_it_runs(two):
    assert two[0]["tp"]["plans"] == two[1]["tp"]["plans"] and two[0]["sp"]["plans"] == two[1]["sp"]["plans"]
    assert_expected_inline(two[0]["tp"]["plans"][0], """\
DTensor redistributions (their collectives run in the partition's forward graph, the gradients' in its backward graph):
id  kind     collective          placements                 module             at
 1  capture  all_reduce over tp  Partial(sum) -> Replicate  layers.0.attn.o    tp_gpt.py:52
 1  capture  all_reduce over tp  Partial(sum) -> Replicate  layers.0.mlp.down  tp_gpt.py:63
 2  capture  all_reduce over tp  Partial(sum) -> Replicate  layers.1.attn.o    tp_gpt.py:52
 2  capture  all_reduce over tp  Partial(sum) -> Replicate  layers.1.mlp.down  tp_gpt.py:63""")
    assert_expected_inline(two[0]["sp"]["plans"][0], """\
DTensor redistributions (their collectives run in the partition's forward graph, the gradients' in its backward graph):
id  kind     collective              placements                module             at
 1  capture  all_gather over tp      Shard(1) -> Replicate     layers.0.attn      tp_gpt.py:88
 1  capture  reduce_scatter over tp  Partial(sum) -> Shard(1)  layers.0.attn.o    tp_gpt.py:52
 1  capture  all_gather over tp      Shard(1) -> Replicate     layers.0.mlp       tp_gpt.py:89
 1  capture  reduce_scatter over tp  Partial(sum) -> Shard(1)  layers.0.mlp.down  tp_gpt.py:63
 2  capture  all_gather over tp      Shard(1) -> Replicate     layers.1.attn      tp_gpt.py:88
 2  capture  reduce_scatter over tp  Partial(sum) -> Shard(1)  layers.1.attn.o    tp_gpt.py:52
 2  capture  all_gather over tp      Shard(1) -> Replicate     layers.1.mlp       tp_gpt.py:89
 2  capture  reduce_scatter over tp  Partial(sum) -> Shard(1)  layers.1.mlp.down  tp_gpt.py:63
 2  capture  all_gather over tp      Shard(1) -> Replicate     layers.1           tp_gpt.py:106""")


def test_tp_with_expert_parallel_keeps_the_dispatch_eager(two):
    """TP x EP: the attention partitions (with their TP collectives) and the router/preprocess are captured, the
    token dispatch with its data-dependent all_to_all stays an eager island."""
    for r in range(2):
        run = two[r]["tp_ep"]
        assert "eager" in run["kinds"][0] and "capture" in run["kinds"][0], run["kinds"]
        assert any(g["collectives"].get("all_gather_into_tensor") for g in run["end"]["graphs"])
        assert_expected_inline(run["plans"][0], """\
DTensor redistributions (their collectives run in the partition's forward graph, the gradients' in its backward graph):
id  kind     collective              placements                module           at
 1  capture  all_gather over tp      Shard(1) -> Replicate     layers.0.attn    tp_gpt.py:88
 1  capture  reduce_scatter over tp  Partial(sum) -> Shard(1)  layers.0.attn.o  tp_gpt.py:52
 3  capture  all_gather over tp      Shard(1) -> Replicate     layers.1.attn    tp_gpt.py:88
 3  capture  reduce_scatter over tp  Partial(sum) -> Shard(1)  layers.1.attn.o  tp_gpt.py:52
 4  eager    all_gather over tp      Shard(1) -> Replicate     layers.1         tp_gpt.py:106""")


def test_dtensor_output_in_graph_memory_is_copied_out(two):
    """A frame output that is a DTensor living in graph memory is handed out as a copy (clone_outputs), like a plain
    tensor: outputs held across later replays keep their values."""
    for r in range(2):
        result = two[r]["dtensor_output"]
        assert result["type"] == "DTensor" and result["replays"] >= 2 and result["max_diff"] == 0.0, result


def test_redistribution_of_data_dependent_rows_is_an_eager_collective(two):
    """Rows selected by a mask, then gathered: the all_gather's sizes come from data, so the redistribution is an
    eager island with reason `collective`, at its own line (DTensor.from_local, no collective, is not named)."""
    (found,) = two[0]["data_dependent"]
    assert found["line"], found
    assert_expected_inline(found["reason"], """\
collective: Tensor.redistribute: DTensor redistribution (all_gather over tp) of a tensor whose shape depends on tensor data (u0)
hint: give the redistributed tensor a static shape (pad the selected rows to a fixed capacity, e.g. with torch.nonzero_static), or accept the redistribution running eagerly""")


if __name__ == "__main__":
    serve(work, TIMEOUT_S)

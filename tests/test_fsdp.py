"""FSDP2 (`fully_shard` on each layer and the root) around a model compiled with cudagraph_modules: two CPU ranks
on gloo, emulate driver, reshard_after_forward True and False.

FSDP2 builds each unsharded parameter once and frees / re-allocates its storage (`storage.resize_`) around every
all-gather, so the parameter a captured graph read sits at a new address on the next step. Today the runtime sees
"static input moved" and captures again: the results stay exact, but the graphs are re-captured on most steps.
The "0 re-captures after warmup" tests are marked xfail(strict=True) until the runtime handles it; they then pass
and strict xfail makes them fail until the marks are removed.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

try:
    from tests.spawn import capture_counters, init_gloo, run_ranks, write_result
except ModuleNotFoundError:  # tests/ itself on sys.path
    from spawn import capture_counters, init_gloo, run_ranks, write_result

WORLD = 2
TIMEOUT_S = 120
STEPS = 5
WARMUP_STEPS = 2  # step 1 compiles and warms up, step 2 captures (cuda_graph_warmup_steps=1)
LR = 0.1
OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"], "driver": "emulate",
           "cuda_graph_warmup_steps": 1}
RESHARD = (True, False)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"),
]


# ---- worker (runs in the spawned processes) -------------------------------------------------------------

def _sharded(reshard_after_forward):
    from torch.distributed.fsdp import fully_shard

    from tests.models import dense_gpt

    model = dense_gpt.build(num_layers=2, seed=0)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, reshard_after_forward=reshard_after_forward)


def _train(rank, reshard_after_forward):
    """Eager FSDP2 and compiled FSDP2 side by side, SGD on both; per step the loss difference and the largest
    difference of the local parameter shards after the step."""
    import cgcompile
    from tests.models import dense_gpt

    cgcompile.reset_stats()
    torch._dynamo.reset()
    eager, model = _sharded(reshard_after_forward), _sharded(reshard_after_forward)
    compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (eager, model)]
    records, warm = [], None
    for step in range(STEPS):
        (tokens,) = dense_gpt.example_inputs(seed=10 * step + rank)
        losses = []
        for net, opt in ((eager, opts[0]), (compiled, opts[1])):
            opt.zero_grad(set_to_none=True)
            loss = dense_gpt.loss(net, tokens)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        param_diff = max((p.to_local() - q.to_local()).abs().max().item()
                         for p, q in zip(eager.parameters(), model.parameters()))
        records.append({"loss": losses[0], "loss_diff": abs(losses[0] - losses[1]), "param_diff": param_diff})
        if step == WARMUP_STEPS - 1:
            warm = capture_counters()
    return {"steps": records, "warm": warm, "end": capture_counters()}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port, TIMEOUT_S)
    try:
        result = {f"reshard_after_forward={r}": _train(rank, r) for r in RESHARD}
    finally:
        dist.destroy_process_group()
    write_result(out_dir, rank, result)


# ---- tests (run in pytest) -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(__file__, tmp_path_factory.mktemp("fsdp"), WORLD, TIMEOUT_S, "FSDP2")


@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("rank", range(WORLD))
def test_training_matches_eager_fsdp2(ranks, rank, reshard):
    """Exactly the losses and parameter shards of eager FSDP2 after every SGD step, with graphs captured."""
    run = ranks[rank][f"reshard_after_forward={reshard}"]
    for step in run["steps"]:
        assert step["loss_diff"] == step["param_diff"] == 0.0, run["steps"]
    assert len({s["loss"] for s in run["steps"]}) == STEPS, "new tokens every step"
    assert run["end"]["graphs_captured"] > 0 and run["end"]["replays"] > 0 and not run["end"]["eager_fallbacks"]


@pytest.mark.xfail(strict=True, reason="FSDP2 re-allocates the unsharded parameters' storage every step; the "
                                       "runtime re-captures the graphs that read them (issue 20)")
@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("rank", range(WORLD))
def test_no_recapture_after_warmup(ranks, rank, reshard):
    run = ranks[rank][f"reshard_after_forward={reshard}"]
    warm, end = run["warm"], run["end"]
    assert end["recaptures"] == warm["recaptures"] == 0, (warm, end)
    assert end["graphs_captured"] == warm["graphs_captured"] > 0, (warm, end)
    assert end["replays"] > warm["replays"], (warm, end)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

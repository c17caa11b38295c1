"""FSDP2 (`fully_shard` on each layer and the root) around a model compiled with cudagraph_modules: two CPU ranks
on gloo, emulate driver, reshard_after_forward True and False.

FSDP2 frees each unsharded parameter's storage after use and allocates it again for the next all-gather, at a
new address (cgcompile/runtime/frame/fsdp.py). With reshard_after_forward=False the graphs reading those parameters are
captured and FSDP2 keeps their storage; with True they are planned eager (reason fsdp_resharded_params) unless
option fsdp_keep_unsharded keeps them too. Each configuration trains next to eager FSDP2, then releases the graphs
(FSDP2 frees its unsharded storage again) and trains one more step.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

try:
    from tests.spawn import capture_counters, run_ranks, serve
except ModuleNotFoundError:  # tests/ itself on sys.path
    from spawn import capture_counters, run_ranks, serve

WORLD = 2
TIMEOUT_S = 150
STEPS = 5
WARMUP_STEPS = 2  # step 1 compiles and warms up, step 2 captures (cuda_graph_warmup_steps=1)
LR = 0.1
OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"], "driver": "emulate",
           "cuda_graph_warmup_steps": 1}
# (reshard_after_forward, fsdp_keep_unsharded)
RUNS = {"reshard=False": (False, False), "reshard=True": (True, False), "reshard=True+keep": (True, True)}
CAPTURED = ("reshard=False", "reshard=True+keep")

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


def _fsdp_params(model):
    """`model`'s FSDP2 parameters (cgcompile._compat.FsdpParam)."""
    from cgcompile import _compat

    ids = {id(p) for p in model.parameters()}
    return [p for p in _compat.fsdp2_params() if id(p.sharded) in ids]


def _shadowed(model):
    """How many of `model`'s FSDP2 parameters have cgcompile's stand-in for FSDP2's free_unsharded_param."""
    return sum("free_unsharded_param" in vars(p.handle) for p in _fsdp_params(model))


def _held_bytes(model):
    """Bytes of unsharded parameter storage FSDP2 holds for `model` now (0 between steps in eager FSDP2)."""
    return sum(p.unsharded.untyped_storage().nbytes() for p in _fsdp_params(model))


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        if "FSDP2" in record.getMessage():
            self.lines.append(record.getMessage())


def _train(rank, reshard_after_forward, keep):
    """Eager FSDP2 and compiled FSDP2 side by side, SGD on both; per step the loss difference and the largest
    difference of the local parameter shards after the step; counters at the end of warmup and at the end; then
    release() and one more step."""
    import cgcompile
    from cgcompile.backend import record_plans
    from tests.models import dense_gpt

    cgcompile.reset_stats()
    torch._dynamo.reset()
    eager, model = _sharded(reshard_after_forward), _sharded(reshard_after_forward)
    compiled = torch.compile(model, backend="cudagraph_modules", options=dict(OPTIONS, fsdp_keep_unsharded=keep))
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (eager, model)]
    logger, lines = logging.getLogger("cgcompile"), _Lines()
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.INFO

    def step(index):
        (tokens,) = dense_gpt.example_inputs(seed=10 * index + rank)
        losses = []
        for net, opt in ((eager, opts[0]), (compiled, opts[1])):
            opt.zero_grad(set_to_none=True)
            loss = dense_gpt.loss(net, tokens)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        param_diff = max((p.to_local() - q.to_local()).abs().max().item()
                         for p, q in zip(eager.parameters(), model.parameters()))
        return {"loss": losses[0], "loss_diff": abs(losses[0] - losses[1]), "param_diff": param_diff}

    records, warm = [], None
    try:
        with record_plans() as plans:
            for index in range(STEPS):
                records.append(step(index))
                if index == WARMUP_STEPS - 1:
                    warm = capture_counters()
        end, held, logged = capture_counters(), _held_bytes(model), list(lines.lines)
        cgcompile.release()
        released = _held_bytes(model)
        # FSDP2's own free_unsharded_param again (cgcompile shadowed it with an instance attribute)
        shadowed = _shadowed(model)
        after = step(STEPS)
        kept_again, held_after = _shadowed(model), _held_bytes(model)
        del compiled
        torch._dynamo.reset()  # drops the compiled frames, and with them what kept FSDP2's storage
        dropped = _shadowed(model)
    finally:
        logger.removeHandler(lines)
        logger.level = level
    reasons = sorted({f"{r.category}: {r.detail}\nhint: {r.hint}" for g in plans.graphs for p in g.partitions
                      for r in p.reasons if r.category == "fsdp_resharded_params"})
    tagged = [[p.kind, p.reasons[0].category if p.reasons else None] for g in plans.graphs for p in g.partitions
              if p.tags]
    return {"steps": records, "warm": warm, "end": end, "held": held, "released": released, "shadowed": shadowed,
            "after": after, "kept_again": kept_again, "held_after": held_after, "dropped": dropped,
            "held_dropped": _held_bytes(model), "eager_held": _held_bytes(eager), "reasons": reasons,
            "tagged": tagged, "lines": logged}


def work(rank: int, world: int) -> dict:
    return {name: _train(rank, *setting) for name, setting in RUNS.items()}


# ---- tests (run in pytest) -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(__file__, tmp_path_factory.mktemp("fsdp"), WORLD, TIMEOUT_S, "FSDP2")


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("rank", range(WORLD))
def test_training_matches_eager_fsdp2(ranks, rank, run):
    """Exactly the losses and parameter shards of eager FSDP2 after every SGD step, also after release()."""
    result = ranks[rank][run]
    for step in result["steps"] + [result["after"]]:
        assert step["loss_diff"] == step["param_diff"] == 0.0, result["steps"]
    assert len({s["loss"] for s in result["steps"]}) == STEPS, "new tokens every step"
    assert not result["end"]["eager_fallbacks"], result["end"]


@pytest.mark.parametrize("run", CAPTURED)
@pytest.mark.parametrize("rank", range(WORLD))
def test_no_recapture_after_warmup(ranks, rank, run):
    """Graphs captured in warmup are replayed on every later step, never captured again."""
    warm, end = ranks[rank][run]["warm"], ranks[rank][run]["end"]
    assert end["recaptures"] == warm["recaptures"] == 0, (warm, end)
    assert end["graphs_captured"] == warm["graphs_captured"] > 0, (warm, end)
    assert end["replays"] > warm["replays"], (warm, end)


@pytest.mark.parametrize("rank", range(WORLD))
def test_resharded_parameters_are_planned_eager_by_default(ranks, rank):
    result = ranks[rank]["reshard=True"]
    assert result["end"]["graphs_captured"] == 0 and result["held"] == 0, result["end"]
    assert not result["lines"]
    assert_expected_inline(result["reasons"][0], """\
fsdp_resharded_params: reads FSDP2 parameter layers.0.attn.proj.weight: reshard_after_forward=True frees it after forward and gathers it again at a new address, so a graph reading it would be captured again every step
hint: options={'fsdp_keep_unsharded': True} keeps them unsharded and captures (their unsharded bytes stay resident), or fully_shard(..., reshard_after_forward=False)""")
    assert result["tagged"] and all(t == ["eager", "fsdp_resharded_params"] for t in result["tagged"]), result
    assert all(kind == "capture" for kind, _ in ranks[rank]["reshard=True+keep"]["tagged"])


@pytest.mark.parametrize("run", CAPTURED)
@pytest.mark.parametrize("rank", range(WORLD))
def test_kept_storage_is_freed_by_release(ranks, rank, run):
    """Kept: the unsharded bytes of the captured blocks stay between steps (eager FSDP2 holds none); release()
    frees them and gives FSDP2 its own freeing back, the next step keeps them again, and a compiled frame that
    Dynamo drops gives them back too."""
    result = ranks[rank][run]
    assert result["eager_held"] == result["released"] == result["shadowed"] == 0, result
    assert result["held"] == result["held_after"] > 0, result
    assert result["kept_again"] == 24 and result["dropped"] == result["held_dropped"] == 0, result  # 12 per layer


def test_log_names_the_kept_parameters_and_their_bytes(ranks):
    lines = ranks[0]["reshard=False"]["lines"]
    assert_expected_inline("\n".join(lines), """\
cgcompile: graph 0: FSDP2 keeps 12 unsharded parameters resident for captured graphs, 50,816 bytes on this rank (it would free them after each use; cgcompile.release() lets it again): layers.0.ln1.weight, layers.0.ln1.bias, layers.0.attn.qkv.weight, layers.0.attn.qkv.bias and 8 more
cgcompile: graph 0: FSDP2 keeps 12 unsharded parameters resident for captured graphs, 50,816 bytes on this rank (it would free them after each use; cgcompile.release() lets it again): layers.1.ln1.weight, layers.1.ln1.bias, layers.1.attn.qkv.weight, layers.1.attn.qkv.bias and 8 more""")
    keep = ranks[0]["reshard=True+keep"]["lines"]
    assert [line.split(":", 2)[2] for line in keep] == [line.split(":", 2)[2] for line in lines]  # graph index aside


if __name__ == "__main__":
    serve(work, TIMEOUT_S)

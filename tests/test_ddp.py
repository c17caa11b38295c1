"""DistributedDataParallel around a model compiled with cudagraph_modules: two CPU ranks on gloo, emulate driver.

The user wraps the model in DDP and compiles the wrapper. Dynamo's DDP optimizer splits the frame at DDP's
bucket boundaries (a small bucket_cap_mb gives several buckets here), so each piece is its own graph, planned and
captured; DDP's gradient hooks fire between pieces, on the gradients the replayed backward graphs wrote. Each
worker trains a tiny dense GPT for a few SGD steps with new tokens per step, next to the same model under eager
DDP, with static_graph off and on; then gradient accumulation with no_sync; then expert parallelism (EP
all-to-all inside the model) with DDP over the non-expert parameters. Results come back as JSON (tests/spawn.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

try:
    from tests.spawn import capture_counters, run_ranks, serve
except ModuleNotFoundError:  # tests/ itself on sys.path
    from spawn import capture_counters, run_ranks, serve

WORLD = 2
TIMEOUT_S = 150
STEPS = 4
WARMUP_STEPS = 2  # step 1 compiles and warms up, step 2 captures (cuda_graph_warmup_steps=1)
# Dynamo's DDP optimizer always takes 1 MB for the first bucket and refuses a smaller bucket_cap_mb, so the
# model is made wide enough (~2.4 MB of parameters) for 1 MB buckets to split it into several graphs
BUCKET_CAP_MB = 1
D_MODEL = 128
LAYERS = 3
LR = 0.1
OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"], "driver": "emulate",
           "cuda_graph_warmup_steps": 1}

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"),
]


# ---- worker (runs in the spawned processes) -------------------------------------------------------------

def _max_param_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _train(rank, steps, accumulate, static_graph, build, loss_fn, inputs, ddp_kwargs=None, options=OPTIONS):
    """Eager DDP and compiled DDP side by side, SGD on both; per step the loss difference, the largest parameter
    difference after the step, and the counters at the end of warmup and at the end."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cgcompile

    cgcompile.reset_stats()
    torch._dynamo.reset()
    kwargs = dict(bucket_cap_mb=BUCKET_CAP_MB, static_graph=static_graph, **(ddp_kwargs or {}))
    eager, model = build(), build()
    eager_ddp, ddp = DDP(eager, **kwargs), DDP(model, **kwargs)
    compiled = torch.compile(ddp, backend="cudagraph_modules", options=options)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (eager, model)]
    records, warm = [], None
    for step in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        losses = []
        for micro in range(accumulate):
            tokens = inputs(seed=100 * step + 10 * micro + rank)
            last = micro == accumulate - 1
            pair = []
            for wrapper, net in ((eager_ddp, eager_ddp), (ddp, compiled)):
                with contextlib.nullcontext() if last else wrapper.no_sync():
                    loss = loss_fn(net, tokens)
                    loss.backward()
                pair.append(loss.item())
            losses.append(pair)
        grad_diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(eager.parameters(), model.parameters())
                        if p.grad is not None)
        for opt in opts:
            opt.step()
        records.append({"loss_diff": max(abs(a - b) for a, b in losses), "loss": losses[-1][0],
                        "grad_diff": grad_diff, "param_diff": _max_param_diff(eager, model)})
        if step == WARMUP_STEPS - 1:
            warm = capture_counters()
    # all ranks hold the same replicated parameters (DDP averaged the same gradients)
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    flat = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if n not in ignored])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    return {"steps": records, "warm": warm, "end": capture_counters(),
            "ranks_agree": (gathered[0] - gathered[1]).abs().max().item()}


def _dense(rank):
    from tests.models import dense_gpt

    return {"build": lambda: dense_gpt.build(num_layers=LAYERS, seed=0, d_model=D_MODEL), "loss_fn": dense_gpt.loss,
            "inputs": lambda seed: dense_gpt.example_inputs(seed=seed)[0]}


def _graph_count(rank):
    """How many graphs Dynamo hands the backend for one DDP-wrapped step (the bucket split)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgcompile.backend import cudagraph_modules
    from tests.models import dense_gpt

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(len(list(gm.parameters())) + sum(1 for n in gm.graph.nodes if n.op == "placeholder"))
        return cudagraph_modules(gm, example_inputs, options=OPTIONS)

    ddp = DDP(dense_gpt.build(num_layers=LAYERS, seed=0, d_model=D_MODEL), bucket_cap_mb=BUCKET_CAP_MB)
    dense_gpt.loss(torch.compile(ddp, backend=backend), dense_gpt.example_inputs(seed=rank)[0]).backward()
    return len(graphs)


def _expert_parallel(rank):
    """EP model: the experts' all-to-all inside the model, DDP over everything but the experts (each rank owns
    different experts, so they are excluded from DDP's all-reduce, as Megatron does)."""
    from tests.models import ep_moe

    group = dist.group.WORLD

    def build():
        model = ep_moe.build(group=group)
        ignore = [n for n, _ in model.named_parameters() if ".local_experts." in n]
        assert ignore, [n for n, _ in model.named_parameters()]
        model._ddp_params_and_buffers_to_ignore = ignore
        return model

    def inputs(seed):
        return ep_moe.example_inputs(seed=seed, rank=rank)[0]

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        result = _train(rank, STEPS, 1, False, build, ep_moe.loss, inputs)
    model = build()
    result["ignored"] = len(model._ddp_params_and_buffers_to_ignore)
    result["ddp_params"] = sum(1 for n, _ in model.named_parameters() if ".local_experts." not in n)
    return result


def work(rank: int, world: int) -> dict:
    result = {"graphs_per_step": _graph_count(rank)}
    for static_graph in (False, True):
        result[f"static_graph={static_graph}"] = _train(rank, STEPS, 1, static_graph, **_dense(rank))
    result["no_sync"] = _train(rank, STEPS, 2, False, **_dense(rank))
    result["expert_parallel"] = _expert_parallel(rank)
    return result


# ---- tests (run in pytest) -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(__file__, tmp_path_factory.mktemp("ddp"), WORLD, TIMEOUT_S, "DDP")


RUNS = ["static_graph=False", "static_graph=True", "no_sync", "expert_parallel"]


def test_ddp_optimizer_splits_the_frame_at_bucket_boundaries(ranks):
    for result in ranks:
        assert result["graphs_per_step"] > 1, result["graphs_per_step"]


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("rank", range(WORLD))
def test_training_matches_eager_ddp(ranks, rank, run):
    """Exactly the losses, gradients and parameters of eager DDP after every SGD step (same kernels, same
    bucket all-reduces; the graphs replay the eager ops)."""
    steps = ranks[rank][run]["steps"]
    for step in steps:
        assert step["loss_diff"] == step["grad_diff"] == step["param_diff"] == 0.0, steps
    assert len({s["loss"] for s in steps}) == len(steps), "new tokens every step"
    assert ranks[rank][run]["ranks_agree"] == 0.0, "DDP keeps the replicas equal"


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("rank", range(WORLD))
def test_graphs_are_captured_and_never_recaptured_after_warmup(ranks, rank, run):
    warm, end = ranks[rank][run]["warm"], ranks[rank][run]["end"]
    assert warm["graphs_captured"] > 0 and not end["eager_fallbacks"], (warm, end)
    assert end["graphs_captured"] == warm["graphs_captured"], (warm, end)
    assert end["recaptures"] == warm["recaptures"] == 0, (warm, end)
    assert end["replays"] > warm["replays"], (warm, end)


def test_expert_parameters_are_left_out_of_ddp(ranks):
    for result in ranks:
        ep = result["expert_parallel"]
        assert ep["ignored"] > 0 and ep["ddp_params"] > 0, ep


if __name__ == "__main__":
    serve(work, TIMEOUT_S)

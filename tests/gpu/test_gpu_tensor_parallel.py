"""The CUDA twin of tests/test_tensor_parallel.py: tensor parallelism through real CUDA graphs, NCCL inside them.

Two ranks on two GPUs (skipped with fewer): the TP GPT (tests/models/tp_gpt.py) column/row-wise, with sequence
parallel norms, and TP x EP, each compiled with driver="cuda" next to the same eager TP model (tests/tp_steps.py);
the captured graphs hold DTensor's all_reduce / all_gather / reduce_scatter, replayed every step after warmup.
One rank on one GPU (a 1-rank mesh, so DTensor runs no collective): DTensor parameters through real capture, the
part a one-GPU machine can check.
NCCL_GRAPH_REGISTER=0 is set beside expandable segments, as Megatron requires (docs/tensor_parallel.md).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

try:
    from tests import tp_steps
    from tests.spawn import REPO, run_ranks, write_result
except ModuleNotFoundError:  # tests/ itself on sys.path
    import tp_steps
    from spawn import REPO, run_ranks, write_result

TIMEOUT_S = 300
TOLERANCE = 1e-5  # eager and the captured aot graphs run the same aten kernels; cuBLAS may still pick others

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.distributed,
    pytest.mark.timeout(TIMEOUT_S + 60),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()), reason="needs torch.distributed NCCL"),
]


# ---- worker (runs in the spawned processes) -------------------------------------------------------------

def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")  # read by NCCL when the communicator starts
    sys.path.insert(0, REPO)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S), device_id=device)
    import cgcompile
    from torch.distributed.device_mesh import init_device_mesh

    try:
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
        result = {"tp": tp_steps.tp_run(mesh, False, "cuda", device)}
        if world > 1:
            result["sp"] = tp_steps.tp_run(mesh, True, "cuda", device)
            result["tp_ep"] = tp_steps.tp_ep_run(mesh, "cuda", device)
    finally:
        cgcompile.release()  # graphs holding NCCL collectives keep the communicator busy
        torch.cuda.synchronize()
        dist.destroy_process_group()
    write_result(out_dir, rank, result)


# ---- tests (run in pytest) -------------------------------------------------------------------------------

def _check(run, name):
    for step in run["steps"]:
        assert step["loss_diff"] <= TOLERANCE and step["grad_diff"] <= TOLERANCE, (name, run["steps"])
        assert not step["missing_grads"], (name, step)
    warm, end = run["warm"], run["end"]
    assert not end["eager_fallbacks"] and not end["bank_stops"], (name, end)
    assert end["recaptures"] == warm["recaptures"] == 0, (name, warm, end)
    assert end["graphs_captured"] == warm["graphs_captured"] > 0, (name, warm, end)
    assert end["replays"] > warm["replays"], (name, warm, end)
    if "unsharded_loss_diff" in run:  # the TP math: the unsharded model's loss, up to summation order
        assert run["unsharded_loss_diff"] < 1e-4, (name, run["unsharded_loss_diff"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank each)")
def test_two_rank_tp_captures_nccl_collectives_and_matches_eager(tmp_path):
    ranks = run_ranks(__file__, tmp_path, 2, TIMEOUT_S, "NCCL TP")
    for rank, result in enumerate(ranks):
        for name in ("tp", "sp", "tp_ep"):
            _check(result[name], f"rank {rank} {name}")
        forward = [g["collectives"] for g in result["tp"]["end"]["graphs"] if g["kind"] == "forward"]
        assert forward and all(c.get("all_reduce") == 2 for c in forward), forward
        backward = [g["collectives"] for g in result["sp"]["end"]["graphs"] if g["kind"] == "backward"]
        assert backward and all(c.get("reduce_scatter_tensor") for c in backward), backward


def test_one_rank_dtensor_parameters_through_real_capture(tmp_path):
    (result,) = run_ranks(__file__, tmp_path, 1, TIMEOUT_S, "NCCL TP (1 rank)")
    _check(result["tp"], "tp")


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

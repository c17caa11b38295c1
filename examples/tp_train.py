"""Train a tiny GPT with tensor parallelism (DTensor, `parallelize_module`) through the cudagraph_modules backend.

The model is tests/models/tp_gpt.py: q/k/v and the MLP's up projection `ColwiseParallel`, o and the MLP's down
projection `RowwiseParallel`; `--sequence-parallel` adds SequenceParallel norms (all_gather / reduce_scatter instead
of all_reduce); `--dp 2` wraps the TP model in FSDP2 over a second mesh dimension (a 2x2 mesh, 4 ranks). Rank 0
prints the plan (with the table of DTensor redistributions: which collective runs where, captured or not), the
loss going down, and per captured graph the collectives it runs and how often it was replayed.

It starts its own ranks (gloo on the CPU, one process each) unless torchrun started it:

    python examples/tp_train.py                          # 2 ranks, TP over both, emulate driver
    python examples/tp_train.py --sequence-parallel --steps 100
    python examples/tp_train.py --dp 2                   # 4 ranks: FSDP2 over "dp" x TP over "tp"
    torchrun --nproc-per-node 2 examples/tp_train.py     # one GPU per rank: add --device cuda --driver cuda

On a GPU see docs/tensor_parallel.md for the NCCL settings a captured run needs.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.models

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import cgcompile  # noqa: E402
from tests.models import tp_gpt  # noqa: E402
from train_moe import synthetic_batches  # noqa: E402  (examples/ is this script's directory)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--dp", type=int, default=1, help="FSDP2 ranks around them (world = dp * tp)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--driver", default="emulate", help="emulate (CPU) | cuda | eager | auto")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) | cuda (NCCL, one GPU per rank)")
    return parser.parse_args(argv)


def build(args, mesh):
    """The TP model on the "tp" mesh dimension, wrapped in FSDP2 over "dp" when there is one."""
    model = tp_gpt.parallelize(tp_gpt.build().to(args.device), mesh["tp"], args.sequence_parallel)
    if args.dp > 1:
        from torch.distributed.fsdp import fully_shard

        # reshard_after_forward=False: the parameters the captured graphs read keep one address
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    return model


def train(rank: int, args) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(args.device, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    model = build(args, mesh)
    options = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"], "driver": args.driver,
               "cuda_graph_warmup_steps": 2}
    # every rank of a TP group must see the same tokens; each dp rank its own
    data = synthetic_batches(args.batch, args.seq, args.device, seed=mesh["dp"].get_local_rank())
    plan = cgcompile.explain(model, next(data), options=options)  # every rank traces: its collectives run too
    if args.dp > 1:
        # FSDP2 with reshard_after_forward=False keeps the parameters explain()'s forward gathered, and then never
        # gathers the updated ones (eager FSDP2 does the same after any forward without backward): reshard them
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    if rank == 0:
        print(f"world {args.dp * args.tp}: dp={args.dp} x tp={args.tp}, sequence parallel: {args.sequence_parallel}, "
              f"device {args.device}, torch {torch.__version__}\n\n{plan}\n", flush=True)

    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start, first, last = time.perf_counter(), None, None
    for step in range(args.steps):
        loss = tp_gpt.loss(compiled, next(data))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps - 1:
            last = loss.item()  # a host sync: only when printing
            first = last if first is None else first
            if rank == 0:
                print(f"step {step:4d}/{args.steps}  loss {last:.4f}", flush=True)
    if rank == 0:
        stats = cgcompile.stats()
        print(f"\nloss {first:.4f} -> {last:.4f} in {args.steps} steps ({time.perf_counter() - start:.1f} s, the first "
              f"steps include compile and capture)")
        print(f"graphs captured {stats['graphs_captured']}, replays {stats['replays']}, re-captures "
              f"{len(stats['recaptures'])}, eager fallbacks {len(stats['eager_fallbacks'])}")
        for row in stats["graphs"]:
            collectives = ", ".join(f"{name} x{n}" for name, n in sorted(row.get("collectives", {}).items()))
            print(f"  {row['label']}: replayed {row['replays']}x; collectives inside: {collectives or 'none'}")
    cgcompile.release()  # before destroy_process_group: graphs holding NCCL work keep the communicator busy


def _rank_main(rank: int, args, world: int, port: int) -> None:
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        train(rank, args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse(argv)
    world = args.dp * args.tp
    if "RANK" in os.environ:  # started by torchrun: one rank per process already
        rank = int(os.environ["RANK"])
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            train(rank, args)
        finally:
            dist.destroy_process_group()
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # several ranks share this machine's cores
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(args, world, port), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

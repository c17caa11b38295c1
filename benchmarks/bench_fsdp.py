"""FSDP2 memory and copies per training step: eager FSDP2 vs the compiled model (cgcompile/runtime/frame/fsdp.py), on two
CPU ranks (gloo, emulate driver), the tests' 2-layer dense GPT with `fully_shard` on each layer and the root.

Per setting (reshard_after_forward False / True / True with option fsdp_keep_unsharded) and per rank, over the
steps after warmup: the peak and the between-steps bytes of unsharded parameter storage (sampled at every storage
resize FSDP2 makes, and at each step's end), the bytes FSDP2 copies out of its all-gathers per step (the
`fsdp.split_with_sizes_copy` op), graphs captured and re-captures after warmup, and whether losses equal eager's.

    python benchmarks/bench_fsdp.py            # about a minute on a 2-core machine
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # for tests.models

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

STEPS, WARMUP = 6, 2
OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"], "driver": "emulate",
           "cuda_graph_warmup_steps": 1}
SETTINGS = {"reshard_after_forward=False": (False, False), "reshard_after_forward=True": (True, False),
            "reshard_after_forward=True, fsdp_keep_unsharded": (True, True)}


class Meter:
    """Unsharded parameter bytes live now and at peak; bytes FSDP2 copied out of all-gathers."""

    def __init__(self):
        self.params, self.peak, self.copied = [], 0, 0

    def live(self) -> int:
        return sum(p.unsharded.untyped_storage().nbytes() for p in self.params)

    def sample(self) -> None:
        self.peak = max(self.peak, self.live())

    def install(self) -> None:
        import torch.distributed.fsdp  # noqa: F401  (defines the fsdp ops)

        resize = torch.UntypedStorage.resize_
        copy_out = torch.ops.fsdp.split_with_sizes_copy

        def resize_(storage, size):
            out = resize(storage, size)
            self.sample()
            return out

        def split_with_sizes_copy(*args, out, **kwargs):
            result = copy_out(*args, out=out, **kwargs)
            self.copied += sum(t.numel() * t.element_size() for t in out)
            self.sample()
            return result

        torch.UntypedStorage.resize_ = resize_
        torch.ops.fsdp.split_with_sizes_copy = split_with_sizes_copy


def build(reshard):
    from torch.distributed.fsdp import fully_shard

    from tests.models import dense_gpt

    model = dense_gpt.build(num_layers=2, seed=0)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    return fully_shard(model, reshard_after_forward=reshard)


def measure(rank, meter, reshard, keep, compiled):
    import cgcompile
    from cgcompile import _compat
    from tests.models import dense_gpt

    cgcompile.release()
    cgcompile.reset_stats()
    torch._dynamo.reset()
    model = build(reshard)
    net = torch.compile(model, backend="cudagraph_modules", options=dict(OPTIONS, fsdp_keep_unsharded=keep)) \
        if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = {id(p) for p in model.parameters()}
    losses, held, warm = [], 0, None
    for step in range(STEPS):
        if step == WARMUP:
            meter.params = [p for p in _compat.fsdp2_params() if id(p.sharded) in ids]
            meter.peak, meter.copied, warm = 0, 0, cgcompile.stats()
        (tokens,) = dense_gpt.example_inputs(seed=10 * step + rank)
        opt.zero_grad(set_to_none=True)
        loss = dense_gpt.loss(net, tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step >= WARMUP:
            held = max(held, meter.live())
    end = cgcompile.stats()
    steps = STEPS - WARMUP
    result = {"peak": meter.peak, "held": held, "copied": meter.copied // steps, "losses": losses,
              "captured": end["graphs_captured"], "recaptured": end["graphs_captured"] - warm["graphs_captured"],
              "total": sum(p.nbytes for p in meter.params)}
    meter.params = []
    return result


def worker(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    meter = Meter()
    meter.install()
    results = {}
    try:
        for name, (reshard, keep) in SETTINGS.items():
            results[name] = {"eager": measure(rank, meter, reshard, keep, False),
                             "compiled": measure(rank, meter, reshard, keep, True)}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def main() -> int:
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp()
    mp.spawn(worker, args=(2, port, out), nprocs=2, join=True)
    with open(os.path.join(out, "rank0.json")) as f:
        results = json.load(f)
    print(f"torch {torch.__version__}; 2 ranks gloo CPU, emulate driver; rank 0, steps {WARMUP + 1}-{STEPS} "
          f"(after warmup); bytes of unsharded parameter storage")
    print("| setting | run | peak | held between steps | all-gather copy-out / step | graphs captured | "
          "captured after warmup | losses = eager |")
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        for run in ("eager", "compiled"):
            r = runs[run]
            same = "yes" if r["losses"] == runs["eager"]["losses"] else "NO"
            print(f"| {name} | {run} FSDP2 | {r['peak']:,} | {r['held']:,} | {r['copied']:,} | {r['captured']} | "
                  f"{r['recaptured']} | {same} |")
    total = results["reshard_after_forward=False"]["eager"]["total"]
    print(f"unsharded parameter bytes of the whole model per rank: {total:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

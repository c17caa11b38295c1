"""The tensor-parallel training runs the CPU tests (tests/test_tensor_parallel.py, gloo, emulate driver) and their
GPU twin (tests/gpu/test_gpu_tensor_parallel.py, NCCL, cuda driver) share. They run inside spawned ranks (spawn.py)
and return JSON-able results: per step the eager TP model's loss and how far the compiled copy's loss and local
gradients are from it; the cgcompile counters at the end of warmup and at the end; per captured graph the collectives
it runs and its replays; the plans' DTensor redistribution tables.

`tp_run` (TP, or TP with sequence parallel) and `tp_ep_run` (TP x EP) are the scenarios on a 1-D mesh.
"""

from __future__ import annotations

import torch

STEPS = 4
WARMUP_STEPS = 2  # step 1 compiles and warms up, step 2 captures (cuda_graph_warmup_steps=1)
LR = 0.1


def fresh() -> None:
    """Counters and Dynamo's caches start over (which releases the graphs of the run before)."""
    import cgcompile

    cgcompile.reset_stats()
    torch._dynamo.reset()


def options(driver: str, *modules: str) -> dict:
    return {"cuda_graph_impl": "local", "cuda_graph_modules": list(modules), "driver": driver,
            "cuda_graph_warmup_steps": 1, "inner_compiler": "eager"}  # auto's choice off CUDA, on CUDA too


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def counters() -> dict:
    """The counters the tests assert on: captures, replays, re-captures, fallbacks, per partition and per graph."""
    import cgcompile

    s = cgcompile.stats()
    return {"graphs_captured": s["graphs_captured"], "replays": s["replays"], "recaptures": len(s["recaptures"]),
            "recapture_reasons": sorted({r["reason"] for r in s["recaptures"]}),
            "eager_fallbacks": s["eager_fallbacks"], "bank_stops": s["bank_stops"],
            "partitions": {row["partition"]: {"replays": row["replays"], "captures": row["captures"]}
                           for row in s["partitions"]},
            "graphs": [{"label": row["label"], "kind": row["kind"], "replays": row["replays"],
                        "collectives": row.get("collectives", {})} for row in s["graphs"]]}


def train(eager, model, compiled, batches, loss_fn, optimizers=None) -> dict:
    """Eager and compiled copies of one TP model side by side on the same batches (new ones every step); SGD on
    both when `optimizers` (eager's, compiled's). Per step: eager's loss, the loss difference, the largest
    difference of the local gradients (before the optimizer step) and any parameter without a gradient."""
    from cgcompile.backend import record_plans
    from cgcompile.diagnostics import format_redistributions

    steps, warm = [], None
    with record_plans() as plans:
        for index, batch in enumerate(batches):
            losses = []
            for net, opt in zip((eager, compiled), optimizers or (None, None)):
                (opt or net).zero_grad(set_to_none=True)
                loss = loss_fn(net, batch)
                loss.backward()
                losses.append(loss.item())
            missing = [name for name, p in model.named_parameters() if p.grad is None]
            grad_diff = max((local(p.grad) - local(q.grad)).abs().max().item()
                            for p, q in zip(eager.parameters(), model.parameters()) if q.grad is not None)
            for opt in optimizers or ():
                opt.step()
            steps.append({"loss": losses[0], "loss_diff": abs(losses[0] - losses[1]), "grad_diff": grad_diff,
                          "missing_grads": missing})
            if index == WARMUP_STEPS - 1:
                warm = counters()
    return {"steps": steps, "warm": warm, "end": counters(),
            "plans": [format_redistributions(g) for g in plans.graphs],
            "kinds": [[p.kind for p in g.partitions] for g in plans.graphs]}


def tp_run(mesh, sequence_parallel, driver="emulate", device="cpu"):
    """Eager and compiled TP GPT side by side; plus the unsharded model's losses on the same tokens (the TP math)."""
    from tests.models import tp_gpt

    fresh()
    eager, model = (tp_gpt.parallelize(tp_gpt.build().to(device), mesh, sequence_parallel) for _ in range(2))
    compiled = torch.compile(model, backend="cudagraph_modules", options=options(driver, "attn", "mlp"))
    batches = [tp_gpt.example_inputs(seed=step, device=device)[0] for step in range(STEPS)]
    result = train(eager, model, compiled, batches, tp_gpt.loss)
    full = tp_gpt.build().to(device)
    with torch.no_grad():
        result["unsharded_loss_diff"] = max(abs(tp_gpt.loss(full, b).item() - s["loss"])
                                            for b, s in zip(batches, result["steps"]))
    result["q_shard"] = list(local(model.layers[0].attn.q.weight).shape)
    return result


def tp_ep_run(mesh, driver="emulate", device="cpu"):
    """Attention tensor-parallel with sequence parallel norms, the MLPs the expert-parallel MoE over the same ranks."""
    from tests.models import tp_gpt

    fresh()
    group = mesh.get_group()
    eager, model = (tp_gpt.parallelize(tp_gpt.build(expert_group=group).to(device), mesh, True) for _ in range(2))
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options=options(driver, "attn", "moe_router", "moe_preprocess"))
    batches = [tp_gpt.example_inputs(seed=step, device=device)[0] for step in range(STEPS)]
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # the dispatch's .tolist() traced: one island
        return train(eager, model, compiled, batches, tp_gpt.loss)

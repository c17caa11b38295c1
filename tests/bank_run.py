"""The graph bank's memory run shared by tests/test_graph_bank.py (emulate) and tests/gpu/test_gpu_graph_bank.py
(CUDA); apart from them so the GPU twin imports no optional test package."""

import torch

import cgcompile
from tests.models import MODELS

MOE = MODELS["moe_mask"]


def moe_bank_run(steps: int, checkpoints, device: str = "cpu", driver: str = "emulate") -> dict:
    """The issue's run: tests' MoE, default options, 512 new tokens every step, SGD. Per checkpoint step: bytes
    held by live graphs, bytes of the graphs that step used, the live labels, and (CUDA) memory allocated."""
    model = MOE.make(num_layers=2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch._dynamo.reset()
    cgcompile.reset_stats()
    options = {"cuda_graph_impl": "local", "cuda_graph_modules": [], "driver": driver,
               "cuda_graph_warmup_steps": 3,  # the default warmup
               "inner_compiler": "eager"}  # auto's choice off CUDA, on CUDA too: the bank's memory, not Inductor's
    run = torch.compile(model, backend="cudagraph_modules", options=options)
    seen, found = {}, {}
    size = lambda g: g["static_input_bytes"] + g["static_output_bytes"] + g["pool_bytes"]  # noqa: E731
    for i in range(steps):
        (tokens,) = MOE.example_inputs(batch=8, seq=64, seed=i, device=device)
        MOE.loss(run, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        graphs = {g["label"]: g for g in cgcompile.stats()["graphs"]}
        used = [g for label, g in graphs.items() if g["replays"] != seen.get(label)]
        seen = {label: g["replays"] for label, g in graphs.items()}
        if i + 1 in checkpoints:
            allocated = torch.cuda.memory_allocated() if device == "cuda" else 0
            found[i + 1] = (sum(map(size, graphs.values())), sum(map(size, used)), list(graphs), allocated)
    return found

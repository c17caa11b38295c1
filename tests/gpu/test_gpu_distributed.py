"""NCCL on one GPU (world size 1): fixed-shape collectives captured inside CUDA graphs, parity with eager.

Skipped without CUDA/NCCL. Uses the public API only: torch.compile(..., backend="cudagraph_modules",
options={..., "driver": "cuda"}) and the runtime counters (`cgcompile.stats()`). NCCL supports collectives inside CUDA graphs (NCCL >= 2.9); Megatron refuses to capture
with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless NCCL_GRAPH_REGISTER=0 (illegal memory access
otherwise, on pre-Blackwell GPUs for its local impl), so the fixture sets that before NCCL starts.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cgcompile
from cgcompile.backend import cudagraph_modules, record_plans

try:
    from tests.models import ep_moe
    from tests.models._common import seeded
except ModuleNotFoundError:  # tests/ itself on sys.path
    from models import ep_moe
    from models._common import seeded

if dist.is_available():
    import torch.distributed._functional_collectives as funcol

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.distributed,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()), reason="needs torch.distributed NCCL"),
]

D = 64
DESTROY_TIMEOUT_S = 60
STEPS = 5
WARMUP = 2


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")  # read by NCCL when the communicator starts
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    # Graphs holding NCCL collectives keep the communicator busy: destroy them first (cgcompile.release()), and never
    # wait forever on NCCL: a destroy that does not return within the limit fails the run instead of hanging it.
    cgcompile.release()
    torch._dynamo.reset()
    done = threading.Event()
    worker = threading.Thread(target=lambda: (dist.destroy_process_group(), done.set()), daemon=True)
    worker.start()
    worker.join(DESTROY_TIMEOUT_S)
    assert done.is_set(), f"dist.destroy_process_group() did not return within {DESTROY_TIMEOUT_S} s"


# ---- models -------------------------------------------------------------------------------------------------

@cgcompile.tag("tp_mlp")
class PartialSumMLP(nn.Module):
    """A row-parallel-style MLP: each rank's partial output summed with a fixed-shape all_reduce.

    functional=True uses funcol.all_reduce (differentiable in eager and compiled alike); False the c10d
    in-place dist.all_reduce, which Dynamo remaps to the same functional op (use it without gradients: the
    eager c10d op is not differentiable, the remapped one is)."""

    def __init__(self, d: int, group, functional: bool = True):
        super().__init__()
        self.group = group
        self.functional = functional
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        y = self.down(F.gelu(self.up(x)))
        if self.functional:
            return funcol.all_reduce(y, "sum", self.group)
        dist.all_reduce(y, group=self.group)
        return y


class Net(nn.Module):
    def __init__(self, d: int, group, functional: bool = True):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.mlp = PartialSumMLP(d, group, functional)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(h + self.mlp(h))


def build_net(group, functional=True, device="cuda"):
    with seeded(0):
        return Net(D, group, functional).to(device)


# ---- helpers ------------------------------------------------------------------------------------------------

def compile_recording(model, options):
    """torch.compile with the cudagraph_modules backend; every Dynamo graph kept next to its plan."""
    gms = []

    def backend(gm, example_inputs):
        gms.append(gm)
        return cudagraph_modules(gm, example_inputs, options=options)

    return torch.compile(model, backend=backend), gms


def collective_kinds(gm, graph_plan):
    """{op name: [partition kind, ...]} for the collective nodes of one graph."""
    from cgcompile.passes.collectives import is_collective
    from cgcompile.passes.common import op_name

    owner = {name: p.kind for p in graph_plan.partitions for name in p.nodes}
    kinds: dict = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_collective(node) and node.name in owner:
            kinds.setdefault(op_name(node), []).append(owner[node.name])
    return kinds


def run_parity(eager, model, compiled, inputs, loss_fn, train: bool, atol: float = 1e-5):
    """Run eager and compiled side by side; the max output/grad differences over the steps."""
    worst = {"out": 0.0, "grad": 0.0}
    for x in inputs:
        eager.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            ref, out = loss_fn(eager, x), loss_fn(compiled, x)
        worst["out"] = max(worst["out"], (ref - out).abs().max().item())
        if train:
            ref.sum().backward()
            out.sum().backward()
            for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
                assert q.grad is not None, f"no gradient for {name}"
                worst["grad"] = max(worst["grad"], (p.grad - q.grad).abs().max().item())
    assert worst["out"] <= atol and worst["grad"] <= atol, worst
    return worst


def assert_captured(min_graphs: int):
    counters = cgcompile.stats()
    assert counters["graphs_captured"] >= min_graphs, counters
    assert counters["replays"] >= 1, counters
    assert not counters["eager_fallbacks"], counters["eager_fallbacks"]


def _reset_stats():
    cgcompile.reset_stats()


def cuda_options(*modules, **extra):
    return {"cuda_graph_impl": "local", "cuda_graph_modules": list(modules), "driver": "cuda",
            "cuda_graph_warmup_steps": WARMUP, "inner_compiler": "eager", **extra}


# ---- tests --------------------------------------------------------------------------------------------------

def test_all_reduce_captured_in_training_graphs(nccl_group):
    _reset_stats()
    eager, model = build_net(nccl_group), build_net(nccl_group)
    compiled, gms = compile_recording(model, cuda_options("tp_mlp"))
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(8, D, device="cuda", generator=g) for _ in range(STEPS)]
    with record_plans() as rec:
        run_parity(eager, model, compiled, inputs, lambda m, x: m(x), train=True)
    (gm,), (graph_plan,) = gms, rec.graphs
    assert graph_plan.device == "cuda"
    kinds = collective_kinds(gm, graph_plan)
    assert kinds["_c10d_functional.all_reduce"] == ["capture"] and kinds["_c10d_functional.wait_tensor"] == ["capture"]
    assert any(p.captured and "tp_mlp" in p.tags for p in graph_plan.partitions)
    assert_captured(min_graphs=2)  # forward and backward graphs


def test_inplace_all_reduce_captured_in_inference_graphs(nccl_group):
    _reset_stats()
    eager, model = build_net(nccl_group, functional=False), build_net(nccl_group, functional=False)
    compiled, gms = compile_recording(model, cuda_options("tp_mlp"))
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randn(8, D, device="cuda", generator=g) for _ in range(STEPS)]
    with record_plans() as rec:
        run_parity(eager, model, compiled, inputs, lambda m, x: m(x), train=False)
    (gm,), (graph_plan,) = gms, rec.graphs
    assert collective_kinds(gm, graph_plan)["_c10d_functional.all_reduce"] == ["capture"]
    assert_captured(min_graphs=1)


def test_ep_layer_on_one_gpu_captures_fixed_collectives_and_keeps_dispatch_eager(nccl_group):
    """The EP layer with NCCL: router all_reduce and counts all_to_all inside graphs, the variable token
    all_to_all (after .tolist()) eager between them; loss and grads match eager on every step."""
    _reset_stats()
    eager = ep_moe.build(group=nccl_group).cuda()
    model = ep_moe.build(group=nccl_group).cuda()
    compiled, gms = compile_recording(model, cuda_options(*ep_moe.CUDA_GRAPH_MODULES))
    inputs = [ep_moe.example_inputs(seed=step, device="cuda")[0] for step in range(STEPS)]
    with torch._dynamo.config.patch(capture_scalar_outputs=True), record_plans() as rec:
        run_parity(eager, model, compiled, inputs, ep_moe.loss, train=True)
    assert len(gms) == 1, "new routing must not recompile"
    kinds = collective_kinds(gms[0], rec.graphs[0])
    assert kinds["_c10d_functional.all_reduce"] == ["capture"]
    # funcol.all_to_all_single_autograd (the token all-to-alls) traces to _c10d_functional_autograd.all_to_all_single
    # on torch 2.11 (the GPU image) and to _c10d_functional.all_to_all_single on 2.13; the counts one is the latter.
    a2a = kinds["_c10d_functional.all_to_all_single"] + kinds.get("_c10d_functional_autograd.all_to_all_single", [])
    assert sorted(a2a) == ["capture", "eager", "eager"], a2a  # counts captured; dispatch + combine eager
    assert_captured(min_graphs=2)

"""torchtitan's own MoE (torchtitan 0.3.0, models/common/moe.py) with expert parallelism and FSDP2 over two CPU ranks
on gloo, its experts captured by cudagraph_modules (emulate driver), trained beside an eager copy.

The setting of issue #41: under FSDP2 (bf16 parameters, fp32 reduce, as torchtitan's apply_fsdp_to_decoder sets it)
the experts call `self.w1_EFD.to_local()`, so the tensor reaching the partition is a new object on every call that
still passes isinstance(x, nn.Parameter). The parameter set must not be keyed by that object: the expert
partition is captured once per layer and replayed on every later step, on both ranks alike.

What reaches the partition here: Dynamo traces `to_local()` inside the compiled frame, so the expert partition's
arguments are the FSDP2-unsharded DTensor parameters themselves (registered objects, the set told by object; the
test pins this). The per-call local tensor becomes a partition argument only where a frame boundary (a graph
break) falls between `to_local()` and the expert matmuls; torchtitan 0.3.0's GroupedExperts.forward has none, so
that path is covered by tests/test_param_sets.py, and this test checks torchtitan's real EP + FSDP2 MoE end to end:
exact against eager, captured, replayed, the same graphs on both ranks.

torchtitan is installed by `make` into .venv/torchtitan (tests/torchtitan-requirements.txt; needs Python >= 3.11).
What is torchtitan's own code here: the MoE config builders, set_moe_sharding_config, Module.parallelize (EP over
the "ep" mesh, AllToAllTokenDispatcher with its all-to-all and .tolist() splits), ParallelDims.build_mesh and
apply_fsdp_to_decoder (per-parameter FSDP meshes, bf16/fp32 MixedPrecisionPolicy, reshard_after_forward=True).
What is set for the CPU, each for a stated reason:
- ParallelDims builds its mesh on torchtitan.tools.utils.device_type, which is "cuda" when no accelerator is
  present (tools/utils.py:55), so the test sets parallel_dims.device_type = "cpu".
- spmd_backend "partial_dtensor" (DTensor for the model-parallel axes; torchtitan's pre-spmd_types path): under the
  default "spmd_types", fully_shard wants every parameter on the full SPMD mesh, which only the whole model's
  parallelize gives (torch's _fsdp_param.py raises "When dp_mesh_dims is provided, all parameters must be DTensors").
- set_force_sum_reduction_for_comms(True) on every FSDP module: torchtitan disables FSDP's gradient division, which
  makes FSDP2 reduce-scatter with ReduceOp.PREMUL_SUM(1.0), and gloo has no PREMUL_SUM ("Cannot use
  ReduceOp.PREMUL_SUM with Gloo"). A plain SUM is the same sum.
- router _debug_force_load_balance=True (torchtitan's own switch): balanced round-robin routing, so every rank
  receives the same number of tokens per expert each step and the expert partition keeps one shape (with learned
  routing the shapes change per step; that is the graph bank's and dynamic_padding's subject, not this test's).
- the input is bf16 (FSDP2's bf16 parameters and cast_forward_inputs=False, as in torchtitan's model); the router's
  autocast(float32) is a no-op on the CPU and warns so.
- fsdp_keep_unsharded=True: with torchtitan's reshard_after_forward=True the expert partition is planned eager
  otherwise (reason fsdp_resharded_params, tests/test_fsdp.py), and nothing would be captured.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline

try:
    from tests.spawn import run_ranks, serve
except ModuleNotFoundError:  # tests/ itself on sys.path
    from spawn import run_ranks, serve

WORLD = 2
TIMEOUT_S = 150
STEPS = 5
CAPTURE_STEP = 1  # step 0 compiles and warms up, step 1 captures (cuda_graph_warmup_steps=1)
LAYERS = 2
DIM, HIDDEN, EXPERTS, TOP_K = 16, 32, 4, 2
LR = 0.1
OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": ["experts"], "driver": "emulate",
           "cuda_graph_warmup_steps": 1, "fsdp_keep_unsharded": True}
# where `make` installs torchtitan: beside site-packages of the Python running the tests, not in it
TORCHTITAN_DIR = os.path.join(sys.prefix, "torchtitan")


def _torchtitan_missing() -> str | None:
    """Why the test cannot run here, or None. An installed torchtitan comes before .venv/torchtitan (the workers
    append that to sys.path), so it must be the version this test is written against."""
    if sys.version_info < (3, 11):
        return "torchtitan 0.3.0 needs Python >= 3.11"
    if dist.is_available() and not hasattr(importlib.import_module("torch.distributed.fsdp"), "DataParallelMeshDims"):
        return (f"torchtitan 0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims, which torch {torch.__version__} "
                "lacks")  # torchtitan/distributed/fsdp.py; torch 2.13 has it
    if importlib.util.find_spec("torchtitan") is not None:
        installed = importlib.metadata.version("torchtitan")
        return None if installed == "0.3.0" else f"written against torchtitan 0.3.0, {installed} is installed"
    if not os.path.isdir(os.path.join(TORCHTITAN_DIR, "torchtitan")):
        return (f"torchtitan is not installed: `make` installs it into {TORCHTITAN_DIR} "
                "(tests/torchtitan-requirements.txt)")
    return None


pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"),
    pytest.mark.skipif(_torchtitan_missing() is not None, reason=str(_torchtitan_missing())),
]


# ---- worker (runs in the spawned processes) -------------------------------------------------------------

class _Block(torch.nn.Module):
    """A residual MoE block, with the attributes torchtitan's apply_fsdp_to_decoder reads."""

    moe_enabled = True

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return x + self.moe(x)


class _Decoder(torch.nn.Module):
    """MoE blocks only, with the attributes of torchtitan's Decoder that apply_fsdp_to_decoder reads (no embedding,
    norm or head)."""

    enable_weight_tying = False
    tok_embeddings = norm = lm_head = None

    def __init__(self, moes):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): _Block(moe) for i, moe in enumerate(moes)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


def _build(parallel_dims):
    """torchtitan MoE layers from configs built in code, EP over "ep", FSDP2 with torchtitan's mixed precision."""
    from functools import partial

    import spmd_types as spmd
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.config_utils import (make_moe_config, make_routed_experts_config,
                                                       make_router_config)
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    init = partial(torch.nn.init.trunc_normal_, std=0.2)
    torch.manual_seed(0)  # the same weights on both ranks and in both models
    moes = []
    for _ in range(LAYERS):
        router = make_router_config(dim=DIM, num_experts=EXPERTS, gate_param_init={"weight": init}, top_k=TOP_K)
        router._debug_force_load_balance = True
        config = make_moe_config(
            num_experts=EXPERTS, router=router, load_balance_coeff=None,
            routed_experts=make_routed_experts_config(
                dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS, top_k=TOP_K, comm_backend="standard",
                param_init={name: init for name in ("w1_EFD", "w2_EDF", "w3_EFD")}))
        set_moe_sharding_config(config, enable_ep=True, enable_sp=False,
                                expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)})
        moe = config.build()
        moe.init_states()
        moe.parallelize(parallel_dims)
        moes.append(moe)
    model = _Decoder(moes)
    apply_fsdp_to_decoder(model, parallel_dims.get_mesh(["fsdp"]), param_dtype=torch.bfloat16,
                          reduce_dtype=torch.float32, pp_enabled=False, ep_degree=parallel_dims.ep,
                          edp_mesh=parallel_dims.get_optional_mesh(["efsdp"]))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def _expert_weights_per_call(model) -> dict:
    """What the experts' forward hands on, seen in eager torchtitan: `w1_EFD.to_local()` during forward."""
    from cgcompile.runtime.tensors import registered_parameter

    experts = model.layers["0"].moe.routed_experts.inner_experts
    seen = {}

    def look(module, args):
        a, b = module.w1_EFD.to_local(), module.w1_EFD.to_local()
        seen.update(dtensor=type(module.w1_EFD).__name__, fresh=a is not b,
                    is_parameter=isinstance(a, torch.nn.Parameter), registered=registered_parameter(a),
                    dtype=str(a.dtype), shape=list(a.shape))

    handle = experts.register_forward_pre_hook(look)
    x = torch.zeros(2, 8, DIM, dtype=torch.bfloat16)
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen


def _param_set_identities() -> list:
    """Per captured expert partition, the argument its parameter set is known by (runtime/bank/key.py): its name in
    the traced frame, its type, and whether it is told by object or by storage."""
    from cgcompile.runtime.release import holders

    out = []
    for runtime in holders():
        for runner in getattr(runtime, "runners", list)():
            identity = runner.param_sets
            if runner.frame.startswith("GroupedExperts.forward") and identity.index is not None:
                out.append([runner.inputs.input_names[identity.index], identity.by_object])
    return sorted(out)


def _train(rank: int) -> dict:
    import cgcompile
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from cgcompile.backend import record_plans
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    # ParallelDims gives its size-1 mesh axes torch's "fake" backend, which torch registers when
    # torch.testing._internal.distributed.fake_pg is imported (torchtitan's model code imports it; import it here)
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    parallel_dims_module.device_type = "cpu"  # torchtitan.tools.utils says "cuda" when no accelerator is present
    set_spmd_backend("partial_dtensor")
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=WORLD, cp=1, tp=1, pp=1, ep=WORLD, world_size=WORLD,
                                 spmd_backend="partial_dtensor")
    parallel_dims.build_mesh()

    cgcompile.reset_stats()
    torch._dynamo.reset()
    eager, model = _build(parallel_dims), _build(parallel_dims)
    per_call = _expert_weights_per_call(eager)
    cgcompile.tag_modules(model, {"layers.*.moe.routed_experts.inner_experts": "experts"})
    compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (eager, model)]

    def expert_partitions():
        return sorted((p for p in cgcompile.stats()["partitions"] if p["frame"].startswith("GroupedExperts.forward")),
                      key=lambda p: p["partition"])

    steps = []
    with record_plans() as plans:
        for index in range(STEPS):
            x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(10 * index + rank)).bfloat16()
            losses = []
            for net, opt in ((eager, opts[0]), (compiled, opts[1])):
                opt.zero_grad(set_to_none=True)
                loss = net(x).float().pow(2).mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            param_diff = max((p.to_local() - q.to_local()).abs().max().item()
                             for p, q in zip(eager.parameters(), model.parameters()))
            steps.append({"loss": losses[0], "loss_diff": abs(losses[0] - losses[1]), "param_diff": param_diff,
                          "replays": [p["replays"] for p in expert_partitions()],
                          "captures": [p["captures"] for p in expert_partitions()]})
    s = cgcompile.stats()
    identities = _param_set_identities()
    tagged = [[p.kind, [r.category.value for r in p.reasons]] for g in plans.graphs for p in g.partitions if p.tags]
    del compiled
    torch._dynamo.reset()
    return {"per_call": per_call, "identities": identities, "steps": steps, "tagged": tagged,
            "eager_fallbacks": s["eager_fallbacks"],
            "recaptures": len(s["recaptures"]), "graphs_captured": s["graphs_captured"],
            # stats() lists them in no fixed order (runtimes are held in a weak set): sorted to compare ranks
            "graphs": sorted([g["label"], g["kind"], g["collectives"]] for g in s["graphs"]),
            "partitions": sorted([p["partition"], p["frame"], p["captures"], p["recaptures"], p["replays"], p["calls"]]
                                 for p in s["partitions"])}


def work(rank: int, world: int) -> dict:
    result = _train(rank)
    dist.barrier()
    return result


# ---- test (runs in pytest) -------------------------------------------------------------------------------

def test_torchtitan_ep_fsdp2_experts_capture_and_replay_the_same_graphs_on_every_rank(tmp_path):
    ranks = run_ranks(__file__, tmp_path, WORLD, TIMEOUT_S, "torchtitan EP + FSDP2")
    for rank, result in enumerate(ranks):
        # the setting: a new bf16 tensor per call that passes isinstance(x, nn.Parameter) unregistered
        assert result["per_call"] == {"dtensor": "DTensor", "fresh": True, "is_parameter": True,
                                      "registered": False, "dtype": "torch.bfloat16",
                                      "shape": [EXPERTS // WORLD, HIDDEN, DIM]}, result["per_call"]
        steps = result["steps"]
        for step in steps:  # exactly eager torchtitan: losses and the local parameter shards after every step
            assert step["loss_diff"] == step["param_diff"] == 0.0, steps
        assert len({s["loss"] for s in steps}) == STEPS, "new tokens every step"
        # one expert partition per layer, captured in the capture step and never again ...
        assert all(s["captures"] == [0] * LAYERS for s in steps[:CAPTURE_STEP]), steps
        assert all(s["captures"] == [1] * LAYERS for s in steps[CAPTURE_STEP:]), steps
        # ... and replayed again on every later step (forward and backward: the replays of each grow by 1 a step)
        for before, after in zip(steps[CAPTURE_STEP:], steps[CAPTURE_STEP + 1:]):
            assert [b + 1 for b in before["replays"]] == after["replays"], steps
        assert result["recaptures"] == 0 and result["eager_fallbacks"] == [], result
        assert result["tagged"] == [["capture", []]] * LAYERS, result["tagged"]
    # the same graphs on both ranks (a rank capturing a graph with a collective its peer runs eagerly would hang)
    assert ranks[0]["graphs"] == ranks[1]["graphs"] and ranks[0]["partitions"] == ranks[1]["partitions"]
    assert_expected_inline("\n".join(f"{label} {collectives}" for label, _, collectives in ranks[0]["graphs"]), """\
graph 14 submod_0 in GroupedExperts.forward (moe.py:71) [2x32x16,2,32x16,...] params 0 #1 backward {'all_to_all_single': 1}
graph 14 submod_0 in GroupedExperts.forward (moe.py:71) [2x32x16,2,32x16,...] params 0 #1 forward {'all_to_all_single': 1}
graph 7 submod_0 in GroupedExperts.forward (moe.py:71) [2x32x16,2,32x16,...] params 0 #1 backward {'all_to_all_single': 1}
graph 7 submod_0 in GroupedExperts.forward (moe.py:71) [2x32x16,2,32x16,...] params 0 #1 forward {'all_to_all_single': 1}""")
    # what the expert partition's parameter set is known by: Dynamo traces `to_local()` inside the frame, so the
    # partition receives the FSDP2-unsharded DTensor parameter itself (registered, told by object), not the per-call
    # local tensor (that one reaches a partition only across a frame boundary: tests/test_param_sets.py)
    assert ranks[0]["identities"] == ranks[1]["identities"]
    assert_expected_inline("\n".join(str(i) for i in ranks[0]["identities"]), """\
['argument `self._modules.inner_experts._parameters.w1_EFD` (read at moe.py:71)', True]
['argument `self._modules.inner_experts._parameters.w1_EFD` (read at moe.py:71)', True]""")
    assert_expected_inline("\n".join(str(p) for p in ranks[0]["partitions"]), """\
['graph 14 submod_0', 'GroupedExperts.forward (moe.py:71)', 1, 0, 3, 5]
['graph 7 submod_0', 'GroupedExperts.forward (moe.py:71)', 1, 0, 3, 5]""")


if __name__ == "__main__":
    if os.path.isdir(TORCHTITAN_DIR):
        sys.path.append(TORCHTITAN_DIR)  # after site-packages: the venv's own packages win
    serve(work, TIMEOUT_S)

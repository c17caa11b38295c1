"""Expert parallelism on two CPU processes: gloo over loopback, spawned by the test itself, time-bounded.

One module fixture starts 2 worker processes (this file run as a script) that each:
- check the EP model in eager mode against one process holding every expert (the EP math itself);
- compile the EP model with backend "cudagraph_modules" and capture_scalar_outputs=True (the dispatch's
  `.tolist()` traced, split sizes unbacked), run 2 steps with different routing and compare loss and every
  parameter gradient with the eager model; record each graph's plan and where every collective landed;
- run it with driver="emulate" (capture and replay emulated on the CPU) and compare again;
- with default Dynamo flags, `cgcompile.explain` (the `.tolist()` is a Dynamo graph break) and a 3-step run
  with cuda_graph_modules=[] (whole layer) where the split sizes come back as Python ints.
The results come back as JSON; the tests below assert on them per rank. A worker that hangs is killed at the
deadline and the tests fail with its output.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

try:
    from tests.spawn import run_ranks, serve
except ModuleNotFoundError:  # tests/ itself on sys.path
    from spawn import run_ranks, serve

WORLD = 2
TIMEOUT_S = 100
STEPS = 2
OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "moe_router", "moe_preprocess"]}
EMULATE_OPTIONS = dict(OPTIONS, driver="emulate", cuda_graph_warmup_steps=1)
EMULATE_STEPS = 3

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"),
]

# the autograd-aware token all-to-all traces to the first on torch 2.13 and to the second on torch 2.11
A2A_OPS = {"_c10d_functional.all_to_all_single", "_c10d_functional_autograd.all_to_all_single"}


# ---- worker (runs in the spawned processes) -------------------------------------------------------------

def _line(location):
    """'/abs/path/ep_moe.py:144' -> 'ep_moe.py:144'."""
    return os.path.basename(location) if location else None


def _plan_summary(graph_plan, gm):
    """JSON-able plan of one graph, plus where each collective node landed (its partition's kind)."""
    from cgcompile.passes.collectives import is_collective
    from cgcompile.passes.common import node_location
    from cgcompile.passes.common import op_name

    owner = {name: p for p in graph_plan.partitions for name in p.nodes}
    collectives = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_collective(node) and node.name in owner:
            collectives.append({"op": op_name(node), "line": _line(node_location(node)),
                                "kind": owner[node.name].kind})
    partitions = [{"kind": p.kind, "tags": list(p.tags), "module": p.module, "num_ops": p.num_ops,
                   "reasons": [{"category": r.category, "op": r.op, "line": _line(r.location), "detail": r.detail}
                               for r in p.reasons]}
                  for p in graph_plan.partitions]
    return {"partitions": partitions, "collectives": collectives}


def _compile_recording(model, options):
    """torch.compile with the cudagraph_modules backend, keeping each Dynamo graph next to its plan."""
    from cgcompile.backend import cudagraph_modules

    gms = []

    def backend(gm, example_inputs):
        gms.append(gm)
        return cudagraph_modules(gm, example_inputs, options=options)

    return torch.compile(model, backend=backend), gms


def _reference_check(rank, world, group):
    """EP model (eager) vs one process with all experts on every rank's tokens: logits rows and aux loss."""
    from tests.models import ep_moe

    ep = ep_moe.build(group=group)
    full = ep_moe.build(group=None, num_local_experts=world * ep_moe.NUM_LOCAL_EXPERTS)
    tokens = [ep_moe.example_inputs(rank=r)[0] for r in range(world)]
    with torch.no_grad():
        logits, aux = ep(tokens[rank])
        full_logits, full_aux = full(torch.cat(tokens))
        mean_aux = aux.clone()
        dist.all_reduce(mean_aux, group=group)
        mean_aux /= world
    rows = full_logits[rank * tokens[0].shape[0]:(rank + 1) * tokens[0].shape[0]]
    return {"logits_max_diff": (logits - rows).abs().max().item(),
            "aux_max_diff": (mean_aux - full_aux).abs().item()}


def _emulated_steps(rank, group):
    """driver="emulate", one warmup step: parity per step while partitions are captured and replayed."""
    from tests.models import ep_moe

    from cgcompile import reset_stats, stats

    reset_stats()
    eager, model = ep_moe.build(group=group), ep_moe.build(group=group)
    compiled = torch.compile(model, backend="cudagraph_modules", options=EMULATE_OPTIONS)
    diffs = []
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for step in range(EMULATE_STEPS):
            (tokens,) = ep_moe.example_inputs(seed=10 + step, rank=rank)
            eager.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            ref = ep_moe.loss(eager, tokens)
            ref.backward()
            out = ep_moe.loss(compiled, tokens)
            out.backward()
            grad_diff = max((p.grad - q.grad).abs().max().item()
                            for p, q in zip(eager.parameters(), model.parameters()))
            diffs.append({"loss_diff": abs(ref.item() - out.item()), "grad_diff": grad_diff})
    counters = stats()
    return {"steps": diffs, "stats": {k: counters[k] for k in ("graphs_captured", "replays", "steady_replays",
                                                                "eager_fallbacks")}}


def work(rank: int, world: int) -> dict:
    import cgcompile
    from cgcompile.backend import record_plans
    from tests.models import ep_moe

    group = dist.group.WORLD
    result = {"rank": rank, "ep_lines": {k: ep_moe.ep_lines(k) for k in
                                         ("sync", "a2a", "counts_a2a", "all_reduce")}}
    result["reference"] = _reference_check(rank, world, group)

    # compiled with capture_scalar_outputs=True: one graph, the dispatch planned as an eager island
    eager, model = ep_moe.build(group=group), ep_moe.build(group=group)
    compiled, gms = _compile_recording(model, OPTIONS)
    steps, plans = [], []
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for step in range(STEPS):
            (tokens,) = ep_moe.example_inputs(seed=step, rank=rank)
            eager.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            ref = ep_moe.loss(eager, tokens)
            ref.backward()
            with record_plans() as rec:
                out = ep_moe.loss(compiled, tokens)
                out.backward()
            grads = {}
            for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
                if p.grad is None or q.grad is None:
                    grads[name] = {"missing": True}
                else:
                    grads[name] = {"max_diff": (p.grad - q.grad).abs().max().item(), "norm": p.grad.norm().item()}
            plans.extend(rec.graphs)
            steps.append({"loss": ref.item(), "loss_diff": abs(ref.item() - out.item()), "grads": grads,
                          "new_graphs": len(rec.graphs)})
    result["steps"] = steps
    result["plans"] = [_plan_summary(gp, gm) for gp, gm in zip(plans, gms)]
    result["plan_text"] = str(cgcompile.Plan(cgcompile.CudaGraphConfig.from_options(OPTIONS), list(plans)))

    # the emulate driver: captured partitions (holding the fixed collectives) go through capture and replay
    result["emulate"] = _emulated_steps(rank, group)

    # default Dynamo flags: the .tolist() is a graph break, named by explain
    torch._dynamo.reset()
    (tokens,) = ep_moe.example_inputs(seed=0, rank=rank)
    plan = cgcompile.explain(ep_moe.build(group=group), tokens, options=OPTIONS)
    result["graph_breaks"] = [{"line": _line(b.location), "reason": b.reason.strip().splitlines()[0]}
                              for b in plan.graph_breaks]

    # default flags, whole layer: after a recompile the split sizes enter the graph as Python ints
    torch._dynamo.reset()
    compiled, gms = _compile_recording(ep_moe.build(group=group), {"cuda_graph_impl": "local"})
    plans = []
    for step in range(3):
        (tokens,) = ep_moe.example_inputs(seed=step, rank=rank)
        with record_plans() as rec:
            ep_moe.loss(compiled, tokens).backward()
        plans.extend(rec.graphs)
    result["whole_layer_plans"] = [_plan_summary(gp, gm) for gp, gm in zip(plans, gms)]
    return result


# ---- launcher (runs in pytest) ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the workers once for the module; [result of rank 0, result of rank 1]."""
    return run_ranks(__file__, tmp_path_factory.mktemp("ep"), WORLD, TIMEOUT_S, "EP")


def _lines(result, kind):
    return {f"ep_moe.py:{n}" for n in result["ep_lines"][kind]}


def _main_plan(result):
    """The plan of the one graph compiled with capture_scalar_outputs=True."""
    assert len(result["plans"]) == 1, result["plans"]
    return result["plans"][0]


@pytest.mark.parametrize("rank", range(WORLD))
def test_ep_model_matches_one_process_with_all_experts(ranks, rank):
    ref = ranks[rank]["reference"]
    assert ref["logits_max_diff"] < 1e-5 and ref["aux_max_diff"] < 1e-6, ref


@pytest.mark.parametrize("rank", range(WORLD))
def test_compiled_matches_eager_forward_and_backward(ranks, rank):
    for step in ranks[rank]["steps"]:
        assert step["loss_diff"] < 1e-6, step["loss_diff"]
        missing = [name for name, g in step["grads"].items() if "missing" in g]
        assert not missing, f"parameters without a gradient: {missing}"
        bad = {name: g for name, g in step["grads"].items() if g["max_diff"] > 1e-5 * max(1.0, g["norm"])}
        assert not bad, bad
        # the gradient really flows through both all-to-alls into the router and the attention below them
        assert step["grads"]["layers.0.moe.router.gate.weight"]["norm"] > 0
        assert step["grads"]["layers.0.attn.q_proj.weight"]["norm"] > 0


def test_routing_differs_between_ranks_and_steps(ranks):
    """Different tokens per rank and step, so the all-to-all split sizes really vary."""
    losses = {(r, i): s["loss"] for r in range(WORLD) for i, s in enumerate(ranks[r]["steps"])}
    assert len(set(losses.values())) == len(losses)


@pytest.mark.parametrize("rank", range(WORLD))
def test_new_routing_reuses_the_graph(ranks, rank):
    """Split sizes are unbacked symbols: new routing needs no recompile (and no new capture)."""
    assert [s["new_graphs"] for s in ranks[rank]["steps"]] == [1] + [0] * (STEPS - 1)


@pytest.mark.parametrize("rank", range(WORLD))
def test_plan_captures_attention_router_and_fixed_collectives(ranks, rank):
    result = ranks[rank]
    plan = _main_plan(result)
    captured_tags = {t for p in plan["partitions"] if p["kind"] == "capture" for t in p["tags"]}
    assert {"attn", "moe_router", "moe_preprocess"} <= captured_tags, plan["partitions"]
    placed = {(c["op"], c["line"]): c["kind"] for c in plan["collectives"]}
    # the fixed-shape all_reduce (router aux loss) and the counts all_to_all (preprocess) are captured
    (reduce_line,) = _lines(result, "all_reduce")
    (counts_line,) = _lines(result, "counts_a2a")
    assert placed[("_c10d_functional.all_reduce", reduce_line)] == "capture"
    assert placed[("_c10d_functional.wait_tensor", reduce_line)] == "capture"
    assert placed[("_c10d_functional.all_to_all_single", counts_line)] == "capture"
    assert placed[("_c10d_functional.wait_tensor", counts_line)] == "capture"


@pytest.mark.parametrize("rank", range(WORLD))
def test_plan_leaves_variable_all_to_all_eager_naming_its_lines(ranks, rank):
    result = ranks[rank]
    plan = _main_plan(result)
    a2a_lines, sync_lines = _lines(result, "a2a"), _lines(result, "sync")
    token_a2a = [c for c in plan["collectives"] if c["line"] in a2a_lines]
    # dispatch and combine: an all_to_all_single each (with its wait_tensor on torch 2.13; torch 2.11 traces the
    # autograd-aware op, whose wait is not at these lines)
    assert sum(c["op"] in A2A_OPS for c in token_a2a) == 2, token_a2a
    assert all(c["kind"] == "eager" for c in token_a2a), token_a2a
    reasons = [r for p in plan["partitions"] if p["kind"] == "eager" for r in p["reasons"]]
    collective = [r for r in reasons if r["category"] == "collective"]
    assert {r["line"] for r in collective if r["op"] in A2A_OPS} == a2a_lines
    # the detail says where the split sizes came from: the .tolist() lines
    for r in collective:
        if r["op"] == "_c10d_functional.all_to_all_single":
            assert all(line in r["detail"] for line in sync_lines), r["detail"]
    assert {r["line"] for r in reasons if r["category"] == "host_sync"} == sync_lines


def test_plans_are_the_same_on_every_rank(ranks):
    """NCCL requires every rank to capture (and replay) the same collectives: the plan must not depend on
    the rank's data."""
    def shape(result):
        return [[(p["kind"], tuple(p["tags"]), p["module"], p["num_ops"]) for p in g["partitions"]]
                for g in result["plans"]]

    assert shape(ranks[0]) == shape(ranks[1])


@pytest.mark.parametrize("rank", range(WORLD))
def test_emulated_capture_with_collectives_matches_eager(ranks, rank):
    """The emulate driver captures and replays the partition holding the all_reduce and the counts all_to_all
    while the dispatch runs eagerly between graphs: loss and gradients still match eager every step."""
    emulate = ranks[rank]["emulate"]
    for step in emulate["steps"]:
        assert step["loss_diff"] < 1e-6 and step["grad_diff"] < 1e-5, emulate["steps"]
    stats = emulate["stats"]
    assert stats["graphs_captured"] > 0 and stats["steady_replays"] > 0 and not stats["eager_fallbacks"], stats


@pytest.mark.parametrize("rank", range(WORLD))
def test_default_flags_tolist_is_a_named_graph_break(ranks, rank):
    result = ranks[rank]
    first_tolist = min(_lines(result, "sync"), key=lambda s: int(s.rpartition(":")[2]))
    assert first_tolist in {b["line"] for b in result["graph_breaks"]}, result["graph_breaks"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_default_flags_split_sizes_passed_as_ints_stay_eager(ranks, rank):
    """Whole-layer capture after the graph break: once Dynamo made the split sizes symbolic inputs (they
    changed between calls), the token all-to-alls are eager islands, never one graph per split combination."""
    result = ranks[rank]
    a2a_lines = _lines(result, "a2a")
    dynamic = [c for g in result["whole_layer_plans"] for c in g["collectives"]
               if c["line"] in a2a_lines and c["op"] in A2A_OPS]
    later = [c for g in result["whole_layer_plans"][-2:] for c in g["collectives"] if c["line"] in a2a_lines]
    assert dynamic and later and all(c["kind"] == "eager" for c in later), result["whole_layer_plans"]
    reasons = [r for g in result["whole_layer_plans"][-2:] for p in g["partitions"] for r in p["reasons"]
               if r["category"] == "collective"]
    assert any("Python ints" in r["detail"] for r in reasons), reasons


if __name__ == "__main__":
    serve(work, TIMEOUT_S)

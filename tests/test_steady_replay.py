"""The steady inference replay (PartitionRunner.__call__): after warmup and capture, a decode step's partition
calls replay a graph captured at an earlier call through one short path, with the same decisions as the full path
(runtime/local/family.py): every case it does not cover (an output still held, a parameter moved, another mode, a released
graph) goes down the full path, and decode stays exact against eager (tokens, caches, version counters)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import cgcompile
from tests import graph_window
from tests.decode_loop import decode, run
from tests.inductor_cpp import needs_inductor_cpp
from tests.models import kv_gpt

PACKAGE = os.path.dirname(cgcompile.__file__)


def one_profiled_step(step, model, prompt, profile) -> None:
    """One decode step after the prompt, with `profile` as the Python profiler (sys.setprofile)."""
    with torch.no_grad():
        token, position = kv_gpt.prefill(model, prompt), torch.tensor([prompt.shape[1]])
        sys.setprofile(profile)
        try:
            step(token, position)
        finally:
            sys.setprofile(None)


def partition_calls(fn) -> list:
    """Per partition call `fn` makes (PartitionRunner.__call__, or .leaving for a frame that is that one call), the
    names of the cgcompile functions it runs in Python, the emulated device's own work (runtime/drivers/emulate.py
    and what it calls) left out."""
    calls: list = []
    stack: list = []  # per frame entered: what it is ("partition", "device" or "")

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if event == "return":
            if stack:
                stack.pop()
            return
        outer = next((kind for kind in reversed(stack) if kind), "")
        if code.co_name in ("__call__", "leaving") and code.co_filename.endswith("runtime/local/runner.py") \
                and outer != "partition":
            stack.append("partition")
            calls.append([code.co_name])
        elif code.co_filename.endswith("runtime/drivers/emulate.py") and outer == "partition":
            stack.append("device")
        else:
            stack.append("")
            if outer == "partition" and code.co_filename.startswith(PACKAGE):
                calls[-1].append(code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("scope", ["layer", "block"])
def test_a_steady_decode_step_replays_each_partition_through_the_short_path(scope, python_host_path):
    graph_window.fresh()  # earlier tests' runtimes leave stats()['partitions'] now, not at a later GC
    model, reference, step = decode(scope)
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 12)  # warmup (3), capture, replays until the bank policy judged them
    partitions = len(cgcompile.stats()["partitions"])
    before = cgcompile.stats()["steady_replays"]
    calls = partition_calls(lambda: run(step, model, reference, prompt, 4))
    steady = cgcompile.stats()["steady_replays"] - before
    assert steady == len(calls) == 4 * partitions  # every partition call replayed a graph captured earlier
    # what a replay runs in Python: the call, the memory claim, the pool rule, the replay, the pool rule's note;
    # the pool rule also finds the graphs after it free once a step (the previous step's layers: held); the
    # replays are counted on the bank policy's clocks and in stats() in a batch (catch_up), at a record's first
    # replay and when the policy is due: a sweep of a layer's graphs once per RELEASE_WINDOW of its calls
    # (replay_blocker is the one rule the full path calls too)
    # (block scope: the frame is the one partition call, whose output leaves the frame copied straight out of the
    # graph's memory: PartitionRunner.leaving, replay_plain's copy_out; nothing is handed out of its memory, so
    # its claim is free again at once: handed_nothing)
    core = ["leaving", "find", "replay_blocker", "take", "pool_blocker", "replay_plain", "after_replay",
            "mark_in_flight"] if scope == "block" else [
        "__call__", "find", "replay_blocker", "take", "pool_blocker", "_replayed", "replay_plain", "after_replay",
        "mark_in_flight"]  # (take:
    # _referenced unless the
    # pool rule found the graph free already)
    settle = {"catch_up", "_count", "add_replays", "steady_replays", "size_seen", "after_call", "sweep",
              "cycle", "is_stale", "release", "quiet_calls"}
    for names in calls:
        remaining = iter(names)
        assert all(name in remaining for name in core), names  # in this order, others between them
        # (<listcomp>: replay_plain's aliases of a graph with several outputs, a frame of its own before Python
        # 3.12: in layer scope the first layer's graph also returns the position and mask the later ones read)
        assert set(names) - set(core) <= {"held", "_referenced", "handed_nothing", "<listcomp>"} | settle, names
        assert names.count("replay_plain") == names.count("take") == 1, names
    held_checks = sum(name == "held" for names in calls for name in names)
    assert held_checks <= 2 * len(calls)  # graph.held and its claim's, at most once per graph and step
    settles = sum(name == "catch_up" for names in calls for name in names)
    assert settles <= partitions + len(calls) // 8, settles  # each record's first, then once per window at most
    assert sum(name == "after_call" for names in calls for name in names) <= len(calls) // 8


@needs_inductor_cpp
def test_inductor_inner_compiler_replays_through_the_same_short_path_as_eager(python_host_path):
    """Issue 36: the host work per replay with inner_compiler="inductor" is the eager inner compiler's. Inductor's
    inference graph is as direct as aot's (its runtime wrapper only calls it), so its steady replays take the short
    path too; before, every call went through aot's wrapper and the full path (the GPU's unexplained 0.48 vs
    0.37 ms decode step). Checked call by call: the same cgcompile functions run per partition call."""
    per_inner = {}
    for inner in ("eager", "inductor"):
        torch._dynamo.reset()
        model, _, step = decode("block", layers=1, inner=inner)
        (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
        with torch.no_grad():  # Inductor's kernels round differently: tests/test_decode.py checks its tokens
            kv_gpt.generate(step, model, prompt, 12)  # warmup (3), capture, replays until the policy judged them
            per_inner[inner] = partition_calls(lambda: kv_gpt.generate(step, model, prompt, 4))
    assert per_inner["inductor"] == per_inner["eager"]
    assert all(names[0] == "leaving" and "replay_plain" in names for names in per_inner["inductor"])  # block scope


def test_a_steady_step_calls_the_split_graph_and_its_eager_parts_through_their_generated_forward():
    """Issue 36, the lean step: Dynamo's graph modules are lazy (torch.fx's _LazyGraphModule). A frame that kept
    `split_gm.forward`, the lazy stub, went through a recompile check and nn.Module.__call__ on every step, and so
    did each eager partition of the split graph (layer scope: the embeddings, mask, head between the layers'
    graphs). A step now makes only the compiled model's own module calls (torch.compile's wrapper, the model)."""
    model, reference, step = decode("layer")
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 6)  # warmup, capture, replays
    names: list = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name in ("_call_impl", "_lazy_forward", "real_recompile"):
            caller = frame.f_back
            while caller is not None and not caller.f_code.co_filename.endswith("runtime/drivers/emulate.py"):
                caller = caller.f_back
            if caller is None:  # not the emulated device running the graph's code
                names.append(frame.f_code.co_name)

    one_profiled_step(step, model, prompt, profile)
    assert names == ["_call_impl", "_call_impl"], names


def test_a_frame_captured_whole_calls_its_partition_without_the_split_graphs_forward(python_host_path):
    """Issue 36, the lean step: in block scope the split graph is one call of the one partition, and its generated
    forward only renamed, passed on and cleared the block's hundred-odd arguments: the frame now calls the
    partition straight from its own function (split.single_call), nothing in between but the lock every frame's call
    holds (serialized.py); and the partition, whose
    result is the frame's output, hands it out copied out of graph memory itself (PartitionRunner.leaving): the
    frame's own function is that call, with no pass over its outputs after it (finish_frame_outputs)."""
    model, reference, step = decode("block", layers=3)
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 6)
    chain: list = []
    finished: list = []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "finish_frame_outputs":
            finished.append(code.co_name)
        if code.co_filename.endswith("cgcompile/scope.py") and code.co_name == "__call__":
            chain.append("frame")
        elif chain and chain[-1] != "partition":
            if code.co_filename.endswith("runtime/local/runner.py") and code.co_name == "leaving":
                chain.append("partition")
            else:
                chain.append(code.co_name)

    one_profiled_step(step, model, prompt, profile)
    # the scope looked up in the frame's own call; "serialized": the frame's calls one at a time, whose compiled
    # wrapper this Python host path stands in for (runtime/local/serialized.py)
    assert chain == ["frame", "serialized", "whole_leaving", "partition"], chain
    assert finished == []


@pytest.mark.parametrize("scope", ["layer", "block"])
def test_a_cache_written_by_a_steady_replay_bumps_its_version_as_eager_does(scope):
    """Autograd's saved-tensor check compares versions: a call that writes the cache must bump its version as
    eager's one index_copy_ per cache does. A graph's kernels bump none (the emulate driver models that), so the
    steady path bumps them itself, as aot's wrapper does for the graph it calls."""
    model, reference, step = decode(scope)
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 6)  # warmup, capture, steady replays

    def versions_after_one_step(m, decode_step):
        with torch.no_grad():
            token = kv_gpt.prefill(m, prompt)
            before = [b._version for name, b in m.named_buffers() if "cache" in name]
            decode_step(token, torch.tensor([prompt.shape[1]]))
        return [b._version - v for v, (name, b) in zip(before, ((n, b) for n, b in m.named_buffers() if "cache" in n))]

    steady = cgcompile.stats()["steady_replays"]
    got = versions_after_one_step(model, step)
    assert cgcompile.stats()["steady_replays"] > steady  # the step was served by replays
    assert got == versions_after_one_step(reference, kv_gpt.DecodeStep(reference)) == [1] * len(got)


def test_caches_made_under_inference_mode_have_no_version_and_decode_replays():
    """A model built under inference_mode holds inference tensors, which have no version counter: nothing reads or
    bumps one, and the decode step is captured and replayed like eager."""
    with torch.inference_mode():
        model = kv_gpt.build(num_layers=2).eval()
        reference = kv_gpt.build(num_layers=2).eval()
    options = {"cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": "block", "driver": "emulate"}
    step = torch.compile(kv_gpt.DecodeStep(model), backend="cudagraph_modules", options=options)
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    cgcompile.reset_stats()
    with torch.inference_mode():
        got = kv_gpt.generate(step, model, prompt, 8)
        want = kv_gpt.generate(kv_gpt.DecodeStep(reference), reference, prompt, 8)
    assert torch.equal(got, want)
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [] and st["steady_replays"] == 8 - 4  # all but warmup (3) and capture


def keep_every_output(options, copied_outputs):
    """A small inference model compiled with `options` (emulate driver), called 10 times by a caller keeping
    every output: each kept output equals eager's, one graph served every call after warmup (3) and capture, and
    `copied_outputs` positions were handed out as copies. Returns the outputs and the cgcompile functions the last
    call ran in its partition (partition_calls)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 6)).eval()
    compiled = torch.compile(model, backend="cudagraph_modules", options={"driver": "emulate", **options})
    inputs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(i)) for i in range(10)]
    with torch.no_grad():
        kept = [compiled(x) for x in inputs[:-1]]
        calls = partition_calls(lambda: kept.append(compiled(inputs[-1])))
        want = [model(x) for x in inputs]
    for got, expected in zip(kept, want):
        assert torch.equal(got, expected)
    (row,) = cgcompile.stats()["partitions"]
    assert row["copied_outputs"] == copied_outputs and row["captures"] == 1
    (graph,) = cgcompile.stats()["graphs"]
    assert graph["steady_replays"] == len(kept) - 4  # all but the three warmup calls and the capture call
    (names,) = calls
    return kept, names


def test_outputs_a_caller_keeps_are_handed_out_as_copies_by_the_steady_path():
    """A caller keeping every output (clone_outputs=False: the frame hands out the partition's output itself): the
    warmup runs show the output still referenced at the next call, so from the capture on that position is handed
    out as a copy, and the steady path replays the one graph with that copy (the full replay, not the plain one),
    never overwriting what the caller keeps."""
    kept, names = keep_every_output({"clone_outputs": False}, copied_outputs=1)
    assert names == ["__call__", "find", "replay_blocker", "take", "_referenced", "pool_blocker", "_replayed",
                     "replay", "replayed", "add_replays", "after_replay", "mark_in_flight"], names


def test_a_parameter_moved_between_steady_replays_is_captured_again():
    model, reference, step = decode("block")
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 6)
    for m in (model, reference):
        with torch.no_grad():
            m.layers[1].mlp.fc.weight.data = m.layers[1].mlp.fc.weight.data * 1.5  # same Parameter, new memory
    recaptures = len(cgcompile.stats()["recaptures"])
    run(step, model, reference, prompt, 4)  # the moved weight's new values are read
    assert len(cgcompile.stats()["recaptures"]) == recaptures + 1


def test_another_grad_mode_has_its_own_graph_and_the_steady_path_comes_back():
    """Dynamo compiles the frame again under inference_mode (its global-state guard): that frame's partition has
    its own graph; back under no_grad, the first frame's steady replay serves the calls again."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    compiled = torch.compile(model, backend="cudagraph_modules", options={"driver": "emulate"})
    x = torch.randn(2, 8)
    for context in [torch.no_grad] * 6 + [torch.inference_mode] * 6 + [torch.no_grad] * 3:
        with context():
            assert torch.equal(compiled(x), model(x))
    # in order of compile: "graph <index> ..." (by number: "graph 10" comes after "graph 9")
    no_grad, inference = sorted(cgcompile.stats()["graphs"], key=lambda g: int(g["label"].split()[1]))
    assert (no_grad["steady_replays"], inference["steady_replays"]) == (2 + 3, 2)


def test_after_release_the_steady_path_warms_up_and_captures_again():
    model, reference, step = decode("layer")
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 6)
    cgcompile.release()
    assert cgcompile.stats()["graphs"] == []
    run(step, model, reference, prompt, 6)
    assert len(cgcompile.stats()["graphs"]) == len(cgcompile.stats()["partitions"])


def test_stats_count_every_steady_replay_whenever_they_are_read():
    """Steady replays are put on the bank policy's clocks and in stats() in batches (SteadyReplays.catch_up):
    stats() and reset_stats() read between two batches see each replay counted once, and nothing left over."""
    model, reference, step = decode("block")
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 8)
    cgcompile.reset_stats()
    for steps in range(1, 4):
        before = cgcompile.stats()
        run(step, model, reference, prompt, steps)
        after = cgcompile.stats()
        (row_before,), (row_after,) = before["partitions"], after["partitions"]
        assert row_after["calls"] - row_before["calls"] == steps  # one partition call per step
        assert row_after["replays"] - row_before["replays"] == steps  # each a replay
        assert after["steady_replays"] - before["steady_replays"] == after["replays"] - before["replays"] == steps
    cgcompile.reset_stats()
    assert cgcompile.stats()["replays"] == cgcompile.stats()["steady_replays"] == 0  # none left over to count


@pytest.mark.parametrize("end", ["release", "model deleted"])
def test_steady_replays_not_yet_counted_still_count_when_the_graphs_go(end):
    """A partition counts its steady replays in batches: when its graphs are released, or the model and its
    compiled frame are deleted, between two batches, the replays made since the last one are in stats() still."""
    import gc

    model, reference, step = decode("block")
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 8)
    cgcompile.reset_stats()
    run(step, model, reference, prompt, 3)  # one partition call per step, each a steady replay
    if end == "release":
        cgcompile.release()
    else:
        del step, model
        torch._dynamo.reset()
        gc.collect()
    assert cgcompile.stats()["steady_replays"] == cgcompile.stats()["replays"] == 3


def _sweeps(read_stats_every_step: bool, monkeypatch, batches=(4,)) -> tuple:
    """Each parameter set's clock at every sweep of its graphs (the bank policy's release pass) over 48 decode
    steps after warmup and capture, runs of 8 steps from a prompt of each batch size in `batches` in turn; and the
    graphs released, the graphs alive and the partitions' counts at the end."""
    from cgcompile.runtime.local.releaser import GraphReleaser

    seen = []
    real = GraphReleaser.sweep

    def sweep(self, param_set):
        seen.append(self.ledger.param_sets[param_set].calls)
        return real(self, param_set)

    with monkeypatch.context() as patch:
        patch.setattr(GraphReleaser, "sweep", sweep)
        graph_window.fresh()
        model, reference, step = decode("block")
        prompts = [kv_gpt.example_inputs(batch=b, seq=8)[0] for b in batches]
        for prompt in prompts:
            run(step, model, reference, prompt, 6)
        cgcompile.reset_stats()
        if read_stats_every_step:  # every clock brought up to date after each call: replays counted one by one
            step = (lambda compiled: lambda *args: (compiled(*args), cgcompile.stats())[0])(step)
        for i in range(6):  # each run from the prompt again (the cache holds MAX_SEQ positions)
            run(step, model, reference, prompts[i % len(prompts)], 8)
        st = cgcompile.stats()
    rows = [{k: row[k] for k in ("calls", "replays", "captures", "releases")} for row in st["partitions"]]
    return seen, (st["graphs_released"], len(st["graphs"]), rows)


def test_a_set_with_one_live_graph_settles_its_steady_replays_only_when_they_are_read(monkeypatch):
    """With one live graph in a parameter set, a sweep can release nothing while its steady replays keep it in use
    (BankLedger.quiet_calls): counted in batches, they settle only when something reads them, while counted one
    by one they sweep every window; the graphs, releases and counts come out the same."""
    batched, batched_end = _sweeps(False, monkeypatch)
    one_by_one, one_by_one_end = _sweeps(True, monkeypatch)
    assert batched_end == one_by_one_end
    assert len(one_by_one) >= 3 and batched == one_by_one[:len(batched)] and len(batched) < len(one_by_one), (
        batched, one_by_one)


def test_the_bank_policy_sweeps_on_the_same_calls_whether_steady_replays_are_counted_in_batches_or_not(
        monkeypatch):
    """A parameter set with two live graphs (two batch sizes, one dynamic frame): the steady path counts its
    replays on the policy's clocks in batches and settles at the replay where a sweep is due, so the sweeps come on
    the same calls as when each replay is counted at once, with the same graphs released and kept."""
    batched, batched_end = _sweeps(False, monkeypatch, batches=(4, 2))
    one_by_one, one_by_one_end = _sweeps(True, monkeypatch, batches=(4, 2))
    assert batched == one_by_one and len(batched) >= 2, (batched, one_by_one)
    assert batched_end == one_by_one_end


def cgcompile_runtimes() -> list:
    from cgcompile.runtime import release

    return [holder for holder in release.holders() if hasattr(holder, "runners")]


def test_reading_stats_counts_pending_replays_without_running_the_bank_policy(monkeypatch):
    """stats() may be read from another thread than the one replaying: what it brings up to date is counts, and the
    bank policy (sweeps, judgements, releases) runs only at replays."""
    from cgcompile.runtime.local.releaser import GraphReleaser

    model, reference, step = decode("block")
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 8)
    (runner,) = [r for rt in cgcompile_runtimes() for r in rt.runners() if r.steady.records]
    for record in runner.steady.records.values():
        record.quiet = 10 ** 9  # as if a reader came at the replay where a sweep is due, before it settled
    for _ in range(4):
        run(step, model, reference, prompt, 8)  # 32 replays pending: past the next sweep (RELEASE_WINDOW = 16)
    policy_runs = []
    monkeypatch.setattr(GraphReleaser, "after_call", lambda self, key: policy_runs.append(key))
    before = cgcompile.stats()["steady_replays"]
    cgcompile.reset_stats()
    assert before >= 32 and policy_runs == []


def test_a_frame_that_is_one_graph_hands_its_output_out_as_a_copy_without_an_alias(python_host_path):
    """clone_outputs (the default): a frame whose one output is its one graph's output gets it copied straight out
    of graph memory by the steady replay (PartitionRunner.leaving), not an alias then cloned by the frame. A caller
    keeping every output holds no graph memory: one graph serves every call, each kept output keeps its own call's
    values, and no two share memory."""
    kept, names = keep_every_output({}, copied_outputs=0)
    assert names[0] == "leaving" and "replay_plain" in names and "finish_frame_outputs" not in names, names
    # every output in memory of its own (an alias of the graph's output would share its one fixed address)
    assert len({t.data_ptr() for t in kept}) == len(kept)


def test_a_frame_whose_output_is_not_copied_out_by_its_replay_looks_its_record_up_once():
    """A frame that is one partition's call, whose steady replay cannot copy its output out itself (capture_sizes:
    the graph writes into an output arena, so it is no plain graph): the call replays from the record it found
    and the frame copies the output, looking the record up once, not again through the partition's own call."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 6)).eval()
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "capture_sizes": [4, 8]})
    inputs = [torch.randn(3 if i % 2 else 6, 6, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    with torch.no_grad():
        got = [compiled(x) for x in inputs[:-1]]
        calls = partition_calls(lambda: got.append(compiled(inputs[-1])))
        want = [model(x) for x in inputs]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    (names,) = calls
    assert names[0] == "leaving" and names.count("find") == 1 and "replay" in names, names
    assert cgcompile.stats()["steady_replays"] > 0

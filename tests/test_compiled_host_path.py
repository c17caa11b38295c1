"""The compiled host path (cgcompile/csrc): the steady copy-out replay (steady_replay.cpp, armed by
runtime/local/steady.py) and the scope gate (scope_gate.cpp, scope.py). A decode step in block scope, a frame that is
one partition call, replays in one C call once its record is armed, with every decision the Python path makes:
the same tokens, caches, version counters and counts; whatever changed between two calls (a parameter moved, a
release, parameters replaced) sends the call back to the Python path, which decides and arms again."""

from __future__ import annotations

import gc
import os
import sys
import weakref

import pytest
import torch

import cgcompile
from cgcompile import native
from cgcompile.runtime import release
from tests import graph_window
from tests.decode_loop import decode, run
from tests.models import kv_gpt

PACKAGE = os.path.dirname(cgcompile.__file__)
built = pytest.mark.skipif(native.STEADY_REPLAY is None or native.SCOPE_GATE is None,
                           reason="the compiled host path was not built (no C++ compiler)")


def runners() -> list:
    return [r for holder in release.holders() if hasattr(holder, "runners") for r in holder.runners()]


def the_runner(before: list):
    """The one partition runner made since `before` (runners() then: other tests' runtimes may still be alive)."""
    made = [r for r in runners() if all(r is not b for b in before)]
    assert len(made) == 1, [(r.name, r.frame, len(r.steady.records)) for r in made]
    return made[0]


def test_ci_builds_the_compiled_host_path():
    """`pip install -e .` compiles it where a C++ compiler exists; CI's machine has one, so a silently failed build
    (the extensions are optional) would show here rather than as slower steps."""
    if not os.environ.get("CI"):
        pytest.skip("only required where CI runs: without a C++ compiler the Python path is used")
    assert native.STEADY_REPLAY is not None and native.SCOPE_GATE is not None and native.SERIALIZED_CALL is not None


@built
def test_a_steady_block_decode_step_runs_none_of_cgcompiles_python():
    """After warmup, capture and the first steady replay, a step is Dynamo's frame and one C call: no cgcompile
    function runs in Python but the emulated device's own (runtime/drivers/emulate.py, what a GPU does itself)."""
    graph_window.fresh()
    before = runners()
    model, reference, step = decode("block")
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 12)
    steady_before = cgcompile.stats()["steady_replays"]  # reading the counts disarms: the next call arms again
    compiled = the_runner(before).steady.compiled
    ran: list = []
    device: list = []  # the frames of the emulated device's work, open now

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "return" and device and device[-1] is frame:
            device.pop()
        if event != "call" or not code.co_filename.startswith(PACKAGE):
            return
        if code.co_filename.endswith(os.path.join("runtime", "drivers", "emulate.py")):
            device.append(frame)
        elif not device:
            ran.append(f"{os.path.relpath(code.co_filename, PACKAGE)}:{code.co_name}")

    with torch.no_grad():
        token, want = kv_gpt.prefill(model, prompt), kv_gpt.prefill(reference, prompt)
        positions = kv_gpt.positions(model.max_seq)
        token, want = step(token, positions[8]), kv_gpt.DecodeStep(reference)(want, positions[8])  # arms again
        fast = compiled.fast_replays
        tokens = []
        sys.setprofile(profile)
        try:
            for i in range(1, 5):
                token = step(token, positions[8 + i])
                tokens.append(token)
        finally:
            sys.setprofile(None)
        for i in range(1, 5):
            want = kv_gpt.DecodeStep(reference)(want, positions[8 + i])
            assert torch.equal(tokens[i - 1], want)
    assert ran == [], ran
    assert compiled.fast_replays - fast == 4
    assert cgcompile.stats()["steady_replays"] - steady_before == 5  # each counted as a steady replay


def _decode_run(monkeypatch, python: bool) -> dict:
    """30 decode steps in runs of 6, stats() read after each run: what each run saw."""
    with monkeypatch.context() as patch:
        if python:
            patch.setenv(native.PYTHON_HOST_PATH, "1")
        graph_window.fresh()
        before = runners()
        model, reference, step = decode("block")
        caches = [b for name, b in model.named_buffers() if "cache" in name]
        eager_caches = [b for name, b in reference.named_buffers() if "cache" in name]
        (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
        seen = []
        for _ in range(5):
            versions = [c._version for c in caches + eager_caches]
            run(step, model, reference, prompt, 6)
            st = cgcompile.stats()
            (row,) = st["partitions"]
            bumps = [c._version - v for c, v in zip(caches + eager_caches, versions)]
            seen.append({"versions": (bumps[:len(caches)], bumps[len(caches):]),
                         "steady": st["steady_replays"], "replays": st["replays"], "captures": st["graphs_captured"],
                         "graphs": [(g["kind"], g["replays"]) for g in st["graphs"]],
                         "row": {k: row[k] for k in ("calls", "replays", "captures", "releases")}})
        fast = the_runner(before).steady.compiled
        return {"seen": seen, "fast": fast.fast_replays if fast is not None else None}


@built
def test_the_compiled_and_python_host_paths_make_the_same_decode(monkeypatch):
    """The same decode loop with the compiled host path and without it: the same tokens and caches as eager (run),
    the caches' versions bumped once per step as eager's index_copy_ does, the same counts in stats() whenever read;
    and the compiled path served the steady replays between the reads."""
    compiled = _decode_run(monkeypatch, python=False)
    python = _decode_run(monkeypatch, python=True)
    assert compiled["seen"] == python["seen"]
    for ours, eager in (seen["versions"] for seen in compiled["seen"][1:]):  # after warmup and capture: as eager's
        assert ours == eager and all(v == 7 for v in ours)  # the prefill's write and 6 steps
    # after warmup, capture and judgement, every run but its first call (a read of the counts disarms) replays in C
    assert python["fast"] is None and compiled["fast"] >= 4 * (6 - 2), compiled["fast"]


@built
def test_what_changes_between_two_calls_sends_the_call_back_to_the_python_path():
    """Each change the Python path would see: a parameter moved (`.data =`: captured again), every graph released
    (`cgcompile.release()`: warmed up and captured again), the parameters replaced (`load_state_dict(assign=True)`:
    the graphs reading the freed ones released): the call falls back, the step stays exact, and once the Python
    path replays steadily again the compiled path serves the calls."""
    graph_window.fresh()
    before = runners()
    model, reference, step = decode("block")
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 8)
    compiled = the_runner(before).steady.compiled

    def resumes() -> None:
        replayed = compiled.fast_replays
        run(step, model, reference, prompt, 8)
        assert compiled.fast_replays > replayed

    resumes()
    for m in (model, reference):
        with torch.no_grad():
            m.layers[1].mlp.fc.weight.data = m.layers[1].mlp.fc.weight.data * 1.5  # same Parameter, new memory
    recaptures = len(cgcompile.stats()["recaptures"])
    resumes()  # the moved weight's new values are read
    assert len(cgcompile.stats()["recaptures"]) == recaptures + 1

    cgcompile.release()
    assert cgcompile.stats()["graphs"] == []
    run(step, model, reference, prompt, 8)
    resumes()

    released = cgcompile.stats()["graphs_released"]
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    for m in (model, reference):
        m.load_state_dict({k: v.clone() * 0.5 if v.is_floating_point() else v.clone() for k, v in state.items()},
                          assign=True)
    run(step, model, reference, prompt, 8)
    assert cgcompile.stats()["graphs_released"] > released
    resumes()


@built
def test_a_deleted_model_takes_its_compiled_host_path_with_it():
    """The compiled objects hold their runner and frame (reference cycles the collector sees): deleting the model
    and Dynamo's cache frees the runner, and its steady replays made in C are in stats() still."""
    graph_window.fresh()
    before = runners()
    model, reference, step = decode("block")
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    run(step, model, reference, prompt, 8)
    cgcompile.reset_stats()
    run(step, model, reference, prompt, 5)
    runner = weakref.ref(the_runner(before))
    del before
    assert runner().steady.compiled.armed == 1
    del step, model
    torch._dynamo.reset()
    gc.collect()
    assert runner() is None
    assert cgcompile.stats()["steady_replays"] == cgcompile.stats()["replays"] == 5

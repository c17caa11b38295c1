"""A training step compiled whole: `torch.compile(train_step)` over forward, `loss.backward()`, `optimizer.step()`
and `zero_grad`, a common way to compile a loop. Dynamo graph-breaks at `loss.backward()` and runs the backward
pass with its frame hook still set, so every Python frame the backward reaches is one it would compile. cgcompile's
runtime and planner run in there (the backward replays, the backward graphs' lazy compile, the after-backward
callbacks): Dynamo compiled them and handed them to the backend, which planned and captured graphs around its own
helpers (370 frames for four steps of this model). None of cgcompile's code may reach the backend as a graph
(cgcompile/untraced.py); the step stays exact against the same step under torch's own backend="eager" (which
compiles the same optimizer frame), and the model's graphs replay every step."""

from __future__ import annotations

import copy
import os

import torch

import cgcompile
from cgcompile import stats
from cgcompile.backend import cudagraph_modules
from tests.models import dense_gpt

OPTIONS = {"cuda_graph_modules": [], "driver": "emulate", "cuda_graph_warmup_steps": 1}
PACKAGE = os.path.dirname(os.path.abspath(cgcompile.__file__)) + os.sep
EXAMPLES = os.path.join(PACKAGE, "examples") + os.sep  # model code (dense_gpt's blocks come from there): traced


def train_step(model, optimizer, tokens):
    loss = dense_gpt.lm_loss(model(tokens), tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def code_files(gm: torch.fx.GraphModule) -> set:
    """The source files of the code a Dynamo graph was traced from (its nodes' stack traces)."""
    files = set()
    for node in gm.graph.nodes:
        for line in (node.meta.get("stack_trace") or "").splitlines():
            line = line.strip()
            if line.startswith('File "'):
                files.add(os.path.abspath(line.split('"')[1]))
    return files


def test_a_step_compiled_whole_never_hands_cgcompiles_own_code_to_the_backend():
    torch._dynamo.reset()
    cgcompile.reset_stats()
    torch.manual_seed(0)
    reference = dense_gpt.build(2)
    model = copy.deepcopy(reference)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (reference, model)]
    traced = []

    def backend(gm, example_inputs):
        traced.append(code_files(gm))
        return cudagraph_modules(gm, example_inputs, options=OPTIONS)

    eager_step = torch.compile(train_step, backend="eager")
    our_step = torch.compile(train_step, backend=backend)
    steady = []
    for step in range(8):
        tokens = dense_gpt.example_inputs(seed=step)[0]
        expected, got = eager_step(reference, optimizers[0], tokens), our_step(model, optimizers[1], tokens)
        assert torch.equal(got, expected), step
        for p, q in zip(reference.parameters(), model.parameters()):
            assert torch.equal(p, q), step
        steady.append(stats()["steady_replays"])
    ours = sorted({f for files in traced for f in files if f.startswith(PACKAGE) and not f.startswith(EXAMPLES)})
    assert ours == [], ours
    assert any(any(f.endswith("dense_gpt.py") for f in files) for files in traced)  # the model's frame was ours
    # every captured graph (the model's forward and backward, the optimizer's update) replays in each last step
    live = len(stats()["graphs"])
    assert live > 0 and [b - a for a, b in zip(steady[-4:], steady[-3:])] == [live] * 3, (steady, live)
    assert stats()["eager_fallbacks"] == []

"""Several micro-batches in flight, as pipeline schedules run them: GPipe (every forward, then every backward in
order), the reverse order, and 1F1B (at most two in flight, each backward as soon as the next forward ran). Each
micro-batch in flight needs a forward instance of its own, and every graph must replay once the schedule is
running. The instance for the last micro-batch is first needed a step after the others (the first call of a step
is a warmup run), so it lies after their backward graphs in the memory pool, and the pool rule (runtime/memory/
registry.py) forbade those backward graphs to replay while it was held: they ran eagerly at every step, and the
graphs reading their grads in place with them. Such a backward graph is captured again after it, once.
Tiny dense GPT (tests/models), attn and mlp captured, emulate driver (it models the pool: a wrong order fails)."""

from __future__ import annotations

import copy

import pytest
import torch

from cgcompile import stats
from tests.models import dense_gpt
from tests.test_runtime_traps import assert_close

OPTIONS = {"cuda_graph_modules": ["attn", "mlp"], "driver": "emulate", "cuda_graph_warmup_steps": 1}
SCHEDULES = {"gpipe": "f0 f1 f2 b0 b1 b2", "reversed": "f0 f1 f2 b2 b1 b0", "1f1b": "f0 f1 b0 f2 b1 f3 b2 b3"}


def run_schedule(schedule: str, device: str = "cpu", **options) -> list:
    """8 steps of `schedule` on the tiny dense GPT, eager and compiled (OPTIONS and `options`) on `device`: grads
    and parameters equal eager's after every step. Returns the steady replays counted after each step."""
    ops = SCHEDULES[schedule].split()
    eager = dense_gpt.build(2).to(device)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="cudagraph_modules", options={**OPTIONS, **options})
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, model)]
    steady = []
    for step in range(8):
        for run, opt in ((eager, opts[0]), (compiled, opts[1])):
            opt.zero_grad(set_to_none=True)
            losses = {}
            for op in ops:
                micro = int(op[1:])
                if op[0] == "f":
                    (tokens,) = dense_gpt.example_inputs(seed=10 * step + micro, device=device)
                    losses[micro] = dense_gpt.lm_loss(run(tokens), tokens)
                else:
                    losses.pop(micro).backward()
            opt.step()
        for a, b in zip(model.parameters(), eager.parameters()):
            assert_close(a.grad, b.grad)
            assert_close(a, b)
        steady.append(stats()["steady_replays"])
    return steady


def replays_per_step(schedule: str) -> int:
    """Two partitions, a forward and a backward graph each, per micro-batch of the schedule."""
    return 2 * len(SCHEDULES[schedule].split())


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_graph_replays_at_every_step_of_a_pipeline_schedule(schedule):
    steady = run_schedule(schedule)
    assert [b - a for a, b in zip(steady[-4:], steady[-3:])] == [replays_per_step(schedule)] * 3, steady
    assert stats()["eager_fallbacks"] == []

"""A static frame that Dynamo compiled again with dynamic sizes (automatic dynamic shapes) releases its graphs
once the new frame has captured and the old one made no call since (runtime/local/lineage.py): training matches
eager across it, the new frame keeps replaying, and a frame still in use (another grad mode, a call between) keeps
its graphs. The rule itself (`supersedes`) is checked on lineages built by hand."""

from __future__ import annotations

import copy
import gc
import logging
import re

import expecttest
import pytest
import torch
import torch.nn as nn

import cgcompile
from cgcompile.runtime import live_runtimes
from cgcompile.runtime.local.lineage import FrameLineage, Supersession, supersedes

OPTIONS = {"cuda_graph_modules": [], "driver": "emulate", "cuda_graph_warmup_steps": 1}


EARLIER: list = []  # the runtimes alive before the running test (an earlier test's, not yet collected)


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    gc.collect()
    cgcompile.reset_stats()
    EARLIER[:] = live_runtimes()
    yield
    EARLIER.clear()


def frames() -> list:
    """The runtimes of the frames compiled in the running test."""
    return [rt for rt in live_runtimes() if not any(rt is old for old in EARLIER)]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def batch(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def graphs_by_frame() -> dict:
    """{frame's dynamic flag: its runtime's live graphs}, for the one model compiled in the test."""
    runtimes = frames()
    assert len(runtimes) == 2, runtimes
    return {rt.lineage.dynamic: rt.live_graphs() for rt in runtimes}


def graphs_of_the_one_frame() -> list:
    (runtime,) = frames()
    return runtime.live_graphs()


class TestStaticFrameSuperseded(expecttest.TestCase):
    def test_its_graphs_are_released_and_training_matches_eager(self):
        eager_model = mlp()
        model = copy.deepcopy(eager_model)
        compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
        opt_c = torch.optim.SGD(model.parameters(), lr=0.05)
        opt_e = torch.optim.SGD(eager_model.parameters(), lr=0.05)
        sizes = [4] * 6 + [8, 9] * 6 + [4] * 3  # a size change: Dynamo compiles the frame again, batch symbolic
        with self.assertLogs("cgcompile", level=logging.INFO) as logged:
            for i, rows in enumerate(sizes):
                if i == 6:
                    static_graphs = graphs_of_the_one_frame()
                    assert [g.kind for g in static_graphs] == ["forward", "backward"]
                    assert all(g.replays > 1 for g in static_graphs)  # replayed at batch 4 before the change
                    held = cgcompile.stats()["graph_bytes"]  # what they hold
                x = batch(rows, i)
                assert train_step(compiled, opt_c, x) == pytest.approx(train_step(eager_model, opt_e, x), rel=1e-5)
        for p_c, p_e in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p_c, p_e, rtol=1e-5, atol=1e-6)
        by_dynamic = graphs_by_frame()
        assert by_dynamic[False] == [] and all(not g.alive for g in static_graphs)  # the static frame's graphs went
        assert cgcompile.stats()["graphs_released"] == 1  # the forward instance, with its backward
        # the dynamic frame serves every size, batch 4 too (a graph of its own), and replays its graphs
        assert sorted(g.kind for g in by_dynamic[True]) == ["backward"] * 3 + ["forward"] * 3
        forwards = [g for g in by_dynamic[True] if g.kind == "forward"]
        assert all(g.replays > 1 for g in forwards), [g.replays for g in forwards]
        released = [r.getMessage() for r in logged.records if "compiled again with dynamic sizes" in r.getMessage()]
        assert len(released) == 1 and f"{held / 1024:.1f} KiB returned" in released[0], (held, released)
        first, second = (int(n) for n in re.findall(r"graph (\d+)", released[0]))
        assert second == first + 1, released  # the recompile is the next graph the process compiled
        self.assertExpectedInline(re.sub(r"graph \d+", "graph N", released[0]), """cgcompile: graph N was compiled again with dynamic sizes as graph N, which Dynamo now calls for its sizes too: released its 2 graph(s), 9.1 KiB returned (a later call of it captures anew)""")


def test_an_eval_frame_under_no_grad_leaves_the_training_frame_and_its_graphs_alone():
    model = mlp()
    compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(4):
        train_step(compiled, optimizer, batch(4, i))
    training = graphs_of_the_one_frame()[0]
    replays = training.replays
    with torch.no_grad():
        for i in range(6):  # another grad mode and another size: a frame of its own, replaying
            compiled(batch(8, 100 + i))
    for i in range(3):
        train_step(compiled, optimizer, batch(4, 200 + i))
    assert training.alive and training.replays == replays + 3  # the same graph, replayed again
    assert cgcompile.stats()["graphs_released"] == 0


def lineage(index: int, dynamic: bool, *sizes: tuple, training: bool = True, frame: int = 7,
            dtype: torch.dtype = torch.float32) -> FrameLineage:
    return FrameLineage(frame, index, training, dynamic, tuple((dtype, s) for s in sizes))


@pytest.mark.parametrize("new, old, expected", [
    (lineage(1, True, (None, 16), (32, 16)), lineage(0, False, (4, 16), (32, 16)), True),
    (lineage(1, True, (None, 16)), lineage(0, False, (4, 16), (32, 16)), False),  # other inputs
    (lineage(1, True, (None, 16)), lineage(0, False, (4, 8)), False),  # a size the new frame keeps differs
    (lineage(1, True, (None, 16)), lineage(0, False, (4, 16, 1)), False),  # another rank
    (lineage(1, True, (None, 16)), lineage(0, False, (1, 16)), False),  # Dynamo specializes a size of 1
    (lineage(1, True, (None, 16)), lineage(0, False, (4, 16), dtype=torch.bfloat16), False),
    (lineage(1, True, (None, 16), training=False), lineage(0, False, (4, 16)), False),  # another grad mode
    (lineage(1, False, (8, 16)), lineage(0, False, (4, 16)), False),  # the new frame is static too
    (lineage(1, True, (None, 16)), lineage(0, True, (None, 16)), False),  # the old one was dynamic already
    (lineage(0, True, (None, 16)), lineage(1, False, (4, 16)), False),  # compiled before it
    (lineage(1, True, (None, 16), frame=8), lineage(0, False, (4, 16)), False),  # another code object
])
def test_supersedes_only_a_static_recompile_of_the_same_code_it_accepts(new, old, expected):
    assert supersedes(new, old) is expected


class Frame:
    """What Supersession reads of a runtime: its lineage (and, here, a name the test's callables look up)."""

    def __init__(self, name: str, lineage: FrameLineage):
        self.name, self.lineage = name, lineage


def test_a_superseded_frame_called_since_is_kept_and_each_is_judged_once():
    old = lineage(0, False, (4, 16))
    calls = {"called": 3, "idle": 5, "other options": 2, "x": 0}
    runtimes = {name: Frame(name, old) for name in calls if name != "x"}
    runtimes["another code"] = Frame("x", lineage(0, False, (4, 16), frame=9))
    watch = Supersession(lineage(1, True, (None, 16)), list(runtimes.values()),
                         lambda rt: rt.name != "other options", lambda rt: calls[rt.name])
    calls["called"] += 1
    assert [rt.name for rt in watch.due()] == ["idle"]
    assert watch.due() == []

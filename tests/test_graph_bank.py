"""The graph bank's policy end to end (emulate driver): per-partition accounting in stats(), graphs released
when they stop paying, partitions that stop capturing sizes that do not repeat or that re-capture on every call,
each logged once and counted, unique graph labels, and memory that does not grow with the sizes seen."""

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
from cgcompile.runtime.bank import policy as bank_policy
from tests.bank_run import moe_bank_run

# whole-layer mode: mlp() below is one captured partition (its small runs join across the layer cuts)
OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": [], "driver": "emulate", "cuda_graph_warmup_steps": 1}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def compiled(model: nn.Module, **options) -> nn.Module:
    torch._dynamo.reset()
    cgcompile.reset_stats()
    return torch.compile(model, backend="cudagraph_modules", options={**OPTIONS, **options})


def batch(rows: int, seed: int, dynamic: bool = True) -> torch.Tensor:
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    return x


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


@pytest.fixture(autouse=True)
def _no_runtimes_of_earlier_tests():
    """partition_row reads every live runtime's rows: collect the earlier tests' runtimes (reference cycles)."""
    gc.collect()


def partition_row(name_part: str = "") -> dict:
    rows = [p for p in cgcompile.stats()["partitions"] if p["calls"] and name_part in p["partition"]]
    assert len(rows) == 1, rows
    return rows[0]


def messages(caplog, text: str) -> list:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_re_capture_storm_stops_capture_after_a_bounded_number_logged_once(caplog):
    """Parameters re-allocated after every step (as FSDP2 does): the graph re-captures on every call; after
    STORM_STREAK re-captures in a row the partition runs eagerly, the reason logged once, training exact."""
    model = mlp()
    reference = copy.deepcopy(model)
    run = compiled(model)
    caplog.set_level(logging.INFO, logger="cgcompile")
    for i in range(12):
        x = batch(4, i, dynamic=False)
        assert torch.equal(step(run, x), step(reference, x))
        for m in (model, reference):
            for p in m.parameters():
                p.grad = None
                p.data = p.data.clone()  # same Parameter, new memory
    stats = cgcompile.stats()
    row = partition_row()
    assert row["recaptures"] == bank_policy.STORM_STREAK and row["stopped"]
    assert row["captures"] == 1 + bank_policy.STORM_STREAK - 1  # the storming re-capture itself is not made
    assert stats["graphs_captured"] <= 2 * bank_policy.STORM_STREAK  # forward and backward, bounded
    assert stats["graphs"] == []
    assert [s["reason"] for s in stats["bank_stops"]] == [row["stopped"]]
    assert "re-capture storm" in row["stopped"] and "static input" in row["stopped"]
    assert len(messages(caplog, "re-capture storm")) == 1
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_graph_not_replayed_within_the_window_is_released_and_captured_again_when_needed(caplog):
    model = mlp()
    reference = copy.deepcopy(model)
    run = compiled(model)
    caplog.set_level(logging.INFO, logger="cgcompile")
    for i in range(3):  # rows 4: warmup, capture, replay
        assert torch.equal(step(run, batch(4, i)), step(reference, batch(4, i)))
    assert partition_row()["replays"] == 1
    for i in range(2 * bank_policy.RELEASE_WINDOW + 4):  # only rows 6 from now on (2 live graphs: 2x the window)
        assert torch.equal(step(run, batch(6, 10 + i)), step(reference, batch(6, 10 + i)))
    row = partition_row()
    assert row["releases"] == 1 and row["stopped"] is None
    assert cgcompile.stats()["graphs_released"] == 1
    live = cgcompile.stats()["graphs"]
    assert len(live) == 2 and all("[6x8]" in g["label"] for g in live)  # the rows-6 forward and backward
    assert len(messages(caplog, "released")) == 1
    for i in range(2):  # rows 4 again: captured at once (warmed up already), exact
        assert torch.equal(step(run, batch(4, 50 + i)), step(reference, batch(4, 50 + i)))
    assert partition_row()["captures"] == 3
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


class TestSizesThatDoNotRepeat(expecttest.TestCase):
    def test_a_partition_meeting_new_sizes_on_most_calls_stops_capturing_them(self):
        model = mlp()
        reference = copy.deepcopy(model)
        run = compiled(model, max_graphs_per_partition=4)
        rows = [3, 3, 3, 9, 5, 12, 4, 10, 7, 6, 3, 14, 8, 3, 11, 13, 3]  # new sizes in no order, as data picks them
        with self.assertLogs("cgcompile", level="WARNING") as logs:
            for i, n in enumerate(rows):
                self.assertTrue(torch.equal(step(run, batch(n, i)), step(reference, batch(n, i))))
        row = partition_row()
        # each size is judged JUDGE_AFTER calls after it first came: the stop waits until six came once only
        self.assertEqual((row["calls"], row["replays"], row["misses"], row["sizes"]), (17, 4, 13, 12))
        self.assertEqual((row["one_off_sizes"], row["captures"]), (7, 1))  # rows 3, kept and replayed after the stop
        self.assertEqual(len([m for m in logs.output if "stops capturing" in m]), 1)
        self.assertEqual(len(cgcompile.stats()["graphs"]), 2)
        self.assertExpectedInline(row["stopped"], """7 of the 8 input sizes judged so far came once and not again: its input sizes do not repeat (e.g. rows selected by nonzero before a graph break); new sizes run eagerly, the graphs it has keep replaying. Fix: dynamic_padding='buckets' (or 'max') with torch._dynamo.config.capture_dynamic_output_shape_ops=True when the sizes come from nonzero or a boolean mask, or capture_sizes=[...] when they are a batch dimension.""")

    def test_a_cache_grown_at_every_step_is_named_with_the_static_cache_fix(self):
        """A decode loop whose cache is concatenated at every step (transformers' default DynamicCache does this):
        each step is a new size that never comes back. The partition stops capturing them, runs them eagerly
        (exactly), and its message names the growing input and dimension and the fix for a growing sequence."""
        model = ConcatCacheStep().eval()
        run = compiled(model, inference_cuda_graph_scope="layer")
        caches = [torch.zeros(2, 4, 16), torch.zeros(2, 4, 16)]
        with torch.no_grad(), self.assertLogs("cgcompile", level="WARNING") as logs:
            for i in range(16):
                x = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(i))
                (got, caches[0]), (want, caches[1]) = run(x, caches[0]), model(x, caches[1])
                self.assertTrue(torch.equal(got, want) and torch.equal(caches[0], caches[1]))
        [row] = [p for p in cgcompile.stats()["partitions"] if p["stopped"]]
        self.assertEqual(len([m for m in logs.output if "stops capturing" in m]), 1)
        self.assertExpectedInline(re.sub(r"test_graph_bank.py:\d+", "test_graph_bank.py:N", row["stopped"]), """6 of the 6 input sizes judged so far came once and not again: its input sizes do not repeat: argument `cache` (read at test_graph_bank.py:N) dim 1 grew by 1 at each new size (5, 6, 7, ..., 13, 14), a sequence growing at every step (e.g. a KV cache concatenated at each decode step, or a growing batch); new sizes run eagerly, the graphs it has keep replaying. Fix: a cache of fixed size written in place at each step's positions, so every step has the same sizes (transformers: generate(..., cache_implementation="static")), or capture_sizes=[...] when it is a batch dimension.""")


    def test_a_start_position_passed_as_an_int_is_named_with_the_mask_fix(self):
        """Meta's reference Llama decodes with `forward(tokens, start_pos: int)`: its cache is fixed and written in
        place, but attention reads `cache[:, :start_pos + 1]`, a new length at every step. What grew is the
        integer, not a tensor's dimension, and a static cache is no fix: the message says so and names the fix
        (the position as a tensor, the whole cache read under a mask). Exact throughout."""
        model = StartPosCacheStep().eval()
        reference = copy.deepcopy(model)
        run = compiled(model, inference_cuda_graph_scope="layer")
        with torch.no_grad(), self.assertLogs("cgcompile", level="WARNING") as logs:
            for position in range(16):
                x = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(position))
                self.assertTrue(torch.equal(run(x, position), reference(x, position)))
                self.assertTrue(torch.equal(model.cache, reference.cache))
        [row] = [p for p in cgcompile.stats()["partitions"] if p["stopped"]]
        self.assertEqual(len([m for m in logs.output if "stops capturing" in m]), 1)
        self.assertExpectedInline(re.sub(r"test_graph_bank.py:\d+", "test_graph_bank.py:N", row["stopped"]), """6 of the 6 input sizes judged so far came once and not again: its input sizes do not repeat: argument `start_pos` (read at test_graph_bank.py:N), an integer, grew by 1 at each new value (1, 2, 3, ..., 9, 10), a sequence growing at every step (e.g. a decode step's start position, or a step counter); new sizes run eagerly, the graphs it has keep replaying. Fix: pass it as a tensor on the model's device; for a decode position, as transformers' cache_position, reading the whole fixed-size cache with a mask of the positions written so far, so no size depends on its value (a slice such as cache[:, :start_pos + n] has a new length at every step).""")

    def test_a_float_argument_new_at_every_call_is_named_with_the_tensor_fix(self):
        """A temperature passed as a Python float, a new value at every step: Dynamo makes it a graph input after
        its second value, each value a new bank key, never captured. The message names the float and its values
        and the fix (a tensor, copied in at every call), not padding for sizes the data picks. Exact throughout."""
        model = Tempered().eval()
        reference = copy.deepcopy(model)
        run = compiled(model)
        with torch.no_grad(), self.assertLogs("cgcompile", level="WARNING") as logs:
            for step in range(16):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
                self.assertTrue(torch.equal(run(x, 1.0 + step / 8), reference(x, 1.0 + step / 8)))
        [row] = [p for p in cgcompile.stats()["partitions"] if p["stopped"]]
        self.assertEqual(len([m for m in logs.output if "stops capturing" in m]), 1)
        self.assertExpectedInline(re.sub(r"test_graph_bank.py:\d+", "test_graph_bank.py:N", row["stopped"]), """6 of the 6 input sizes judged so far came once and not again: its inputs do not repeat: `item` from Tensor.item (created at test_graph_bank.py:N), a Python float, took a new value at each call (1.625, 1.75, 1.875, 2, 2.125, 2.25); a CUDA graph keeps the value it captured, so each value is a graph of its own. New values run eagerly, the graphs it has keep replaying. Fix: pass it as a tensor on the model's device (torch.tensor(value, device=...)): it is copied into the graph at every call, one graph for every value.""")

    def test_a_new_size_compiles_only_when_it_comes_again(self):
        """At the default warmup, a new size's first call runs uncompiled (one of its warmup calls) and the size
        compiles at its second call, so sizes that never come back cost no aot compile (the growing cache
        above, with transformers' default DynamicCache 2x less time in generate()); a size that repeats is
        captured at the same call as before and replays from the next."""
        model = ConcatCacheStep().eval()
        earlier = set(map(id, live_runtimes()))  # released runtimes Dynamo's reset left in module globals
        run = compiled(model, inference_cuda_graph_scope="layer", cuda_graph_warmup_steps=3)
        caches = [torch.zeros(2, 4, 16), torch.zeros(2, 4, 16)]
        with torch.no_grad(), self.assertLogs("cgcompile", level="WARNING"):
            for i in range(16):
                x = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(i))
                (got, caches[0]), (want, caches[1]) = run(x, caches[0]), model(x, caches[1])
                self.assertTrue(torch.equal(got, want) and torch.equal(caches[0], caches[1]))
        [growing] = [r for rt in live_runtimes() if id(rt) not in earlier for r in rt.runners() if r.stopped]
        self.assertIn("grew by 1 at each new size", growing.stopped)
        row = partition_row(growing.name)
        self.assertEqual((row["sizes"], growing.bank_size(), row["captures"]), (row["calls"], 0, 0))
        earlier = set(map(id, live_runtimes()))

        cache = torch.zeros(2, 4, 16)  # two sizes in turn: each compiles at its 2nd call, captures at its 4th
        run = compiled(model, inference_cuda_graph_scope="layer", cuda_graph_warmup_steps=3)
        banked = []
        with torch.no_grad():
            for i in range(12):
                x = torch.randn(2, 2 + i % 2, 8, generator=torch.Generator().manual_seed(i))
                torch._dynamo.mark_dynamic(x, 1)
                self.assertTrue(torch.equal(run(x, cache)[0], model(x, cache)[0]))
                [runner] = [r for rt in live_runtimes() if id(rt) not in earlier for r in rt.runners()]
                banked.append(runner.bank_size())
        self.assertEqual(banked, [0, 0, 1, 2] + [2] * 8)
        row = partition_row(runner.name)
        self.assertEqual((row["calls"], row["warmup_calls"], row["captures"], row["replays"]), (12, 6, 2, 4))


    def test_a_cache_grown_in_every_layer_of_a_frame_the_layers_share_stops_too(self):
        """Layers that graph-break share one compiled frame, so each decode step's new size meets the partition
        once per layer. A size repeats only when a layer meets it again: no size is compiled, the partition stops
        with the growth named, and each size counts once however many layers met it."""
        model = LayeredConcatCache(layers=4).eval()
        run = compiled(model, inference_cuda_graph_scope="layer", cuda_graph_warmup_steps=3)
        caches = [[torch.zeros(2, 4, 16) for _ in range(4)] for _ in range(2)]
        with torch.no_grad(), self.assertLogs("cgcompile", level="WARNING") as logs:
            for i in range(24):
                x = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(i))
                (got, caches[0]), (want, caches[1]) = run(x, caches[0]), model(x, caches[1])
                self.assertTrue(torch.equal(got, want) and all(map(torch.equal, caches[0], caches[1])))
        [row] = [p for p in cgcompile.stats()["partitions"] if p["stopped"]]
        self.assertEqual(len([m for m in logs.output if "stops capturing" in m]), 1)
        self.assertIn("dim 1 grew by 1 at each new size", row["stopped"])
        self.assertEqual((row["calls"], row["compiled_sizes"], row["sizes"]), (4 * 23, 0, 23))  # steps 2..24: cache sizes 5..27


class LayeredConcatCache(nn.Module):
    """ConcatCacheStep layers with a graph break in each: one compiled frame serves every layer."""

    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList([ConcatCacheStep() for _ in range(layers)])

    def forward(self, x: torch.Tensor, caches: list):
        grown = []
        for layer, cache in zip(self.layers, caches):
            x, cache = layer(x, cache)
            torch._dynamo.graph_break()
            grown.append(cache)
        return x, grown


class ConcatCacheStep(nn.Module):
    """One attention step over a key/value cache grown by concatenation at every call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, cache: torch.Tensor):
        cache = torch.cat([cache, self.kv(x)], dim=1)
        k, v = cache.split(8, dim=-1)
        weights = torch.softmax(self.q(x) @ k.transpose(1, 2), dim=-1)
        return weights @ v, cache


class Tempered(nn.Module):
    """An MLP whose hidden activations are scaled by a temperature given as a Python float."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, temperature: float):
        return self.down(torch.nn.functional.gelu(self.up(x)) / temperature)


class StartPosCacheStep(nn.Module):
    """One attention step over a fixed cache written in place at `start_pos`, read up to it by a slice (the
    reference Llama's decode)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 16)
        self.register_buffer("cache", torch.zeros(2, 32, 16))

    def forward(self, x: torch.Tensor, start_pos: int):
        self.cache[:, start_pos:start_pos + 1] = self.kv(x)
        k, v = self.cache[:, :start_pos + 1].split(8, dim=-1)
        weights = torch.softmax(self.q(x) @ k.transpose(1, 2), dim=-1)
        return weights @ v


def test_moe_with_new_sizes_every_step_holds_memory_that_does_not_grow():
    found = moe_bank_run(16, (10, 16))
    (held_10, _, _, _), (held_16, used_16, labels, _) = found[10], found[16]
    assert held_16 <= 1.5 * used_16
    assert abs(held_16 - held_10) <= 0.1 * held_10
    parts = cgcompile.stats()["partitions"]
    stopped = [p for p in parts if p["stopped"]]
    assert stopped and all("do not repeat" in p["stopped"] for p in stopped)
    kept = [p for p in parts if not p["stopped"] and p["calls"] > 8]
    assert kept and sum(p["replays"] for p in kept) >= 0.9 * sum(p["calls"] - p["warmup_calls"] for p in kept)
    # labels: unique, naming the user's code
    assert len(labels) == len(set(labels)) and all("moe.py:" in label for label in labels)


def test_stats_and_the_capture_summary_count_every_call_of_a_partition(caplog):
    model = mlp()
    run = compiled(model)
    caplog.set_level(logging.INFO, logger="cgcompile")
    for i in range(5):
        step(run, batch(4, i, dynamic=False))
    # the summary comes at the first second use of a graph: call 3 (warmup, capture, replay)
    (summary,) = messages(caplog, "captured 2 graphs")
    assert summary.endswith("submod_0 3/1/1/2"), summary
    row = partition_row()
    assert row["calls"] == 5 and row["replays"] == 3 and row["misses"] == 2 and row["captures"] == 1
    assert row["hit_rate"] == 0.6
    labels = [g["label"] for g in cgcompile.stats()["graphs"]]
    assert len(labels) == 2 and labels[0].endswith(" forward") and labels[1] == labels[0][:-len("forward")] + "backward"
    assert "[4x8] params 0 #1" in labels[0]

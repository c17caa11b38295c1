"""Measured benefit (option measure_benefit) and the graph-memory budget (cuda_graph_memory_budget), issue #38.

CPU times say nothing about a GPU, so every test here replaces the emulate driver's timer with one that reports
scripted times per partition and phase (runtime/drivers/timing.py): a replay slower than its eager call sends
the partition back to eager with reason not_profitable and both times; a budget keeps graph bytes under it and
keeps the partition saving most per byte. Without the options nothing is timed (the emulate default)."""

import copy
import re

import pytest
import torch
from expecttest import assert_expected_inline

import cgcompile
from cgcompile import ConfigError, CudaGraphConfig
from cgcompile.runtime import live_runtimes
from cgcompile.runtime.bank.benefit import BenefitMeter, make_room, pays
from cgcompile.runtime.drivers.emulate import EmulateDriver
from cgcompile.runtime.drivers.timing import Timer
from tests.models import dense_gpt, kv_gpt

OPTIONS = {"driver": "emulate", "cuda_graph_modules": ["attn", "mlp"]}
STEPS = 10


class ScriptedTimer(Timer):
    """Runs the call, reports the seconds scripted for (partition's submodule, "eager" or "replay")."""

    def __init__(self, script):
        super().__init__()
        self.script = script
        self.calls = []

    def measure(self, fn, args, partition, phase):
        self.calls.append((partition.rsplit(" ", 1)[-1], phase))
        return fn(args), self.script[partition.rsplit(" ", 1)[-1]][phase.split()[0]]


@pytest.fixture
def timer(monkeypatch):
    def install(script):
        scripted = ScriptedTimer(script)
        monkeypatch.setattr(EmulateDriver, "timer", scripted)
        return scripted
    yield install
    cgcompile.reset_stats()  # the measured times stay out of later tests' explain() output


def train(options, steps=STEPS, after_step=None):
    """dense_gpt trained `steps` steps compiled and eagerly; the losses must match exactly."""
    model = dense_gpt.build()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    (tokens,) = dense_gpt.example_inputs()
    cgcompile.reset_stats()
    for step in range(steps):
        ours, want = dense_gpt.loss(compiled, tokens), dense_gpt.loss(reference, tokens)
        ours.backward()
        want.backward()
        assert torch.equal(ours, want), step
        if after_step is not None:
            after_step(step)
    return cgcompile.stats()


def graphs_numbered(text):
    """Graph indices count every Dynamo graph of the process: left out of pinned text."""
    return re.sub(r"graph \d+ ", "graph N ", text)


def live(partition):
    return [g for rt in live_runtimes() for g in rt.live_graphs() if g.partition.endswith(partition)]


def row(stats, partition):
    (found,) = [r for r in stats["partitions"] if r["partition"].endswith(partition)]
    return found


SLOW_SUBMOD_2 = {"submod_1": {"eager": 1e-3, "replay": 0.2e-3}, "submod_2": {"eager": 1e-3, "replay": 2e-3}}


def test_a_slower_replay_goes_back_to_eager_with_not_profitable_and_both_times(timer):
    scripted = timer(SLOW_SUBMOD_2)
    st = train(dict(OPTIONS, measure_benefit="on"))
    (fallback,) = st["eager_fallbacks"]
    assert fallback["partition"].endswith("submod_2")
    assert_expected_inline(fallback["reason"], """\
not_profitable: its replay takes 4.000 ms per call, input copies included, its eager call 2.000 ms (forward+backward): not faster by 5%""")
    assert live("submod_2") == [] and row(st, "submod_2")["fallback"] == fallback["reason"]
    assert {k: row(st, "submod_2")[k] for k in ("eager_ms", "replay_ms", "saving_ms", "profitable")} == {
        "eager_ms": 2.0, "replay_ms": 4.0, "saving_ms": -2.0, "profitable": False}
    # the profitable one is captured and replayed: its graphs ran again after the call that captured them
    fast = row(st, "submod_1")
    assert fast["profitable"] is True and fast["saving_ms"] == 1.6 and fast["fallback"] is None
    assert all(g.replays > 1 for g in live("submod_1"))
    assert {g.kind for g in live("submod_1")} == {"forward", "backward"}
    # timed: warmup calls and 3 replays per kind after the capture, nothing later
    assert scripted.calls.count(("submod_1", "replay forward")) == 3
    assert scripted.calls.count(("submod_1", "replay backward")) == 3
    assert st["benefit"][fast["partition"]]["saving_per_step_ms"] == fast["saving_per_step_ms"]


def test_without_the_option_the_emulate_driver_times_nothing(timer):
    scripted = timer(SLOW_SUBMOD_2)
    st = train(dict(OPTIONS))
    assert scripted.calls == [] and st["eager_fallbacks"] == [] and st["benefit"] == {}
    assert row(st, "submod_2")["profitable"] is None and all(g.replays > 1 for g in live("submod_2"))


def test_nothing_is_timed_without_warmup_calls(timer):
    scripted = timer(SLOW_SUBMOD_2)
    with pytest.warns(UserWarning, match="cuda_graph_warmup_steps=0"):
        st = train(dict(OPTIONS, measure_benefit="on", cuda_graph_warmup_steps=0), steps=4)
    assert scripted.calls == [] and st["benefit"] == {} and st["eager_fallbacks"] == []


def decode(options, steps=16):
    model = kv_gpt.build().eval()
    reference = copy.deepcopy(model)
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    compiled = torch.compile(kv_gpt.DecodeStep(model), backend="cudagraph_modules", options=options)
    cgcompile.reset_stats()
    got = kv_gpt.generate(compiled, model, prompt, steps)
    assert torch.equal(got, kv_gpt.generate(kv_gpt.DecodeStep(reference), reference, prompt, steps))
    return cgcompile.stats()


DECODE = {"cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": "block", "driver": "emulate"}


def test_decode_times_three_replays_then_takes_the_steady_path(timer):
    scripted = timer({"submod_0": {"eager": 1e-3, "replay": 0.1e-3}})
    st = decode(dict(DECODE, measure_benefit="on"))
    assert scripted.calls.count(("submod_0", "replay inference")) == 3
    assert st["eager_fallbacks"] == [] and st["steady_replays"] == 16 - 3 - 1
    (graph,) = live("submod_0")
    assert graph.replays == 16 - 3
    runner = graph.family.part
    assert runner.benefit.meter.profitable is True and runner.bank_counters().replays == 16 - 3 - 1


def test_decode_slower_replay_runs_eagerly(timer):
    timer({"submod_0": {"eager": 1e-3, "replay": 0.99e-3}})  # faster, but by less than the 5% margin
    st = decode(dict(DECODE, measure_benefit="on"))
    (fallback,) = st["eager_fallbacks"]
    assert "not_profitable" in fallback["reason"] and "0.990 ms" in fallback["reason"]
    assert live("submod_0") == [] and st["steady_replays"] == 3  # the three timed replays, then eager


# --- the memory budget -----------------------------------------------------------------------------------------

# submod_2 saves 6 ms per call, submod_1 0.4 ms: with room for one, submod_2 is the one captured
WORTH = {"submod_1": {"eager": 1e-3, "replay": 0.8e-3}, "submod_2": {"eager": 4e-3, "replay": 1e-3}}


@pytest.mark.parametrize("budget", [150_000, 1_000_000])
def test_graph_bytes_stay_under_the_budget_and_the_best_saving_per_byte_is_captured(timer, budget):
    timer(WORTH)
    held = []
    st = train(dict(OPTIONS, cuda_graph_memory_budget=budget),
               after_step=lambda step: held.append(cgcompile.stats()["graph_bytes"]))
    assert max(held) <= budget
    assert all(g.replays > 1 for g in live("submod_2"))
    if budget == 1_000_000:  # room for both
        assert st["eager_fallbacks"] == [] and all(g.replays > 1 for g in live("submod_1"))
        return
    assert live("submod_1") == []
    (fallback,) = st["eager_fallbacks"]
    assert_expected_inline(graphs_numbered(fallback["reason"]), """\
memory_budget: its graphs (35328 bytes) released to make room for graph N submod_2, which saves more per byte, under cuda_graph_memory_budget=150000 bytes""")


def test_a_budget_nothing_fits_in_keeps_every_partition_eager(timer):
    timer(WORTH)
    st = train(dict(OPTIONS, cuda_graph_memory_budget=1000))
    assert st["graph_bytes"] == 0 and st["graphs_captured"] == 0
    reasons = sorted(f["reason"] for f in st["eager_fallbacks"])
    assert_expected_inline(reasons[0], """\
memory_budget: a new forward graph would hold about 123520 bytes, the model's graphs hold 0 of cuda_graph_memory_budget=1000 bytes, and no graph saving less per byte can make room""")


def test_make_room_and_pays_are_pure():
    assert pays(1.0, 0.95) and not pays(1.0, 0.96)
    assert make_room(10, 5, 20, [("a", 3)]) == []
    assert make_room(10, 15, 20, [("a", 3), ("b", 4), ("c", 9)]) == ["a", "b"]
    assert make_room(10, 15, 20, [("a", 3)]) is None
    meter = BenefitMeter(True)
    meter.eager_sample("inference", 2.0, 100)
    meter.eager_sample("inference", 1.0, 80)
    assert meter.ready() is None and meter.eager_estimate() == 1.0 and meter.bytes_needed("inference") == 100
    for seconds in (0.5, 0.4, 0.6):
        assert meter.wants_replay("inference")
        meter.replay_sample("inference", seconds)
    assert not meter.wants_replay("inference") and meter.ready() == ("inference",)
    assert meter.decide(("inference",)) and meter.saving() == pytest.approx(0.6) and not meter.open


# --- options ---------------------------------------------------------------------------------------------------

def test_options_validate_with_one_clear_error():
    assert CudaGraphConfig.from_options({"measure_benefit": "ON"}).measure_benefit == "on"
    assert CudaGraphConfig.from_options({"cuda_graph_memory_budget": 0.25}).cuda_graph_memory_budget == 0.25
    with pytest.raises(ConfigError) as bad_choice:
        CudaGraphConfig.from_options({"measure_benefit": "sometimes"})
    assert_expected_inline(str(bad_choice.value), """\
measure_benefit='sometimes' is not a valid choice; valid choices: 'auto', 'on', 'off'""")
    for bad in (0, -5, 1.5, 0.0, True, "1GB"):
        with pytest.raises(ConfigError) as bad_budget:
            CudaGraphConfig.from_options({"cuda_graph_memory_budget": bad})
    assert_expected_inline(str(bad_budget.value), """\
cuda_graph_memory_budget='1GB' is not valid; valid values: None (no budget), bytes as an int >= 1 (e.g. 2 * 2**30), or a fraction of the device's memory as a float in (0, 1] (e.g. 0.2)""")


def test_explain_after_a_run_shows_the_measured_times(timer):
    timer(SLOW_SUBMOD_2)
    train(dict(OPTIONS, measure_benefit="on"))
    plan = cgcompile.explain(dense_gpt.build(), *dense_gpt.example_inputs(), options=OPTIONS)
    assert {graphs_numbered(name) for name in plan.to_json()["measured"]} == {"graph N submod_1", "graph N submod_2"}
    assert_expected_inline(graphs_numbered("\n".join(str(plan).splitlines()[-3:])), """\
measured (eager vs replay per call, saving per call and per step):
  graph N submod_1: eager 2.000 ms, replay 0.400 ms, saving 1.600 ms per call, 1.600 ms per step: captured
  graph N submod_2: eager 2.000 ms, replay 4.000 ms, saving -2.000 ms per call, -2.000 ms per step: eager: not_profitable""")


def test_under_the_budget_a_new_size_releases_the_least_used_graph_first(timer):
    """One partition, sizes 16 and 32 in turn (dynamic batch, shared output arena), a budget with room for one
    size's graph: each new size releases the idle graph of the other instead of being refused."""
    timer({"submod_0": {"eager": 1e-3, "replay": 0.1e-3}})

    @cgcompile.tag("mlp")
    class MLP(torch.nn.Sequential):
        pass

    model = MLP(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    options = {"driver": "emulate", "cuda_graph_modules": ["mlp"], "cuda_graph_memory_budget": 20_000}
    compiled = torch.compile(model, backend="cudagraph_modules", options=options, dynamic=True)
    cgcompile.reset_stats()
    held = []
    with torch.no_grad():
        for batch in [16] * 6 + [32] * 6 + [16] * 3:
            x = torch.randn(batch, 64)
            assert torch.equal(compiled(x), model(x))
            st = cgcompile.stats()
            held.append((batch, st["graph_bytes"], [g["label"].split(" [")[1] for g in st["graphs"]]))
    assert max(nbytes for _, nbytes, _ in held) <= 20_000 and st["eager_fallbacks"] == []
    assert held[-1] == (16, 12288, ["16x64] params 0 #3 inference"])  # 32's graph released to make room
    assert (live("submod_0")[0].replays, st["graphs_released"]) == (3, 2)


def test_a_graph_larger_than_its_estimate_is_caught_once_captured(timer, monkeypatch):
    """The estimate from the warmup calls can fall short (on CUDA the pool holds the graph's temporaries too): the
    graph's real bytes are checked after its capture, and past the budget the partition runs eagerly."""
    timer(WORTH)
    monkeypatch.setattr(BenefitMeter, "bytes_needed", lambda self, kind: 0)  # every capture looks free
    held = []
    st = train(dict(OPTIONS, cuda_graph_memory_budget=100_000),
               after_step=lambda step: held.append(cgcompile.stats()["graph_bytes"]))
    assert max(held) <= 100_000 and len(st["eager_fallbacks"]) == 1
    assert live("submod_2") == [] and live("submod_1") and all(g.replays > 1 for g in live("submod_1"))  # the one whose capture passed it
    assert_expected_inline(graphs_numbered(st["eager_fallbacks"][0]["reason"]), """\
memory_budget: its graphs hold 88192 bytes once captured, more than estimated, and the model's graphs 123520 bytes, over cuda_graph_memory_budget=100000 bytes""")

"""Captures that cannot be used fall back, logged once, and training goes on exactly: a parameter moved to a new
address (recaptured), the graph bank's cap reached (eager), a capture that fails (eager). The small models and
helpers of test_runtime_traps.py, through the real backend with the emulate driver."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from cgcompile import stats
from cgcompile.backend import record_plans
from cgcompile.runtime.drivers import base as driver_mod
from cgcompile.runtime.drivers import emulate as emulate_driver
from cgcompile.runtime.drivers import select as drivers_mod
from tests.test_runtime_traps import assert_close, batch, compiled, grads, twins


def test_param_address_change_recaptures():
    ref, model = twins()
    cmodel = compiled(model)
    for step in range(4):
        x, _ = batch(step)
        assert_close(cmodel(x), ref(x))
    with torch.no_grad():
        for m in (model, ref):
            m.head.weight.mul_(2)
    model.head.weight.data = model.head.weight.data.clone()  # same values, new address
    x, _ = batch(9)
    assert_close(cmodel(x), ref(x))
    s = stats()
    assert len(s["recaptures"]) == 1 and "moved" in s["recaptures"][0]["reason"]


def test_graph_bank_cap_falls_back_to_eager(caplog):
    ref, model = twins()
    cmodel = compiled(model, max_graphs_per_partition=1, clone_outputs=False)
    kept = []
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for step in range(4):
            x, _ = batch(step)
            kept.append((cmodel(x), ref(x)))  # held outputs keep instance 0 busy
    for out, expected in kept:
        assert_close(out, expected)
    s = stats()
    assert s["eager_fallbacks"] and all("max_graphs_per_partition=1" in f["reason"] for f in s["eager_fallbacks"])
    cap_warnings = [r for r in caplog.records if "max_graphs_per_partition" in r.getMessage()]
    assert len(cap_warnings) == len({f["partition"] for f in s["eager_fallbacks"]})


class _FailingDriver(emulate_driver.EmulateDriver):
    def capture(self, fn, static_inputs, pool=None, **options):
        raise driver_mod.CaptureError("injected failure")


def test_injected_capture_failure_falls_back(caplog, monkeypatch):
    ref, model = twins()
    monkeypatch.setattr(drivers_mod, "EmulateDriver", _FailingDriver)
    cmodel = compiled(model)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for step in range(4):
            model.zero_grad(), ref.zero_grad()
            x, y = batch(step)
            F.mse_loss(cmodel(x), y).backward()
            F.mse_loss(ref(x), y).backward()
            for a, b in zip(grads(model), grads(ref)):
                assert_close(a, b)
    s = stats()
    assert s["graphs_captured"] == 0
    names = [f["partition"] for f in s["eager_fallbacks"]]
    assert names and len(names) == len(set(names))
    warnings = [r for r in caplog.records if "injected failure" in r.getMessage()]
    assert len(warnings) == len(names)
    assert all("test_runtime_traps.py:" in r.getMessage() for r in warnings)  # names the model code's location


KEPT_GRAD_HISTORY = [(0, 0), (2, 0), (2, 2), (2, 2), (2, 4), (2, 6)]


def train_keeping_a_grad(cmodel, model, ref, make_x, close, steps=6):
    """Train `cmodel` (compiled `model`) beside `ref` as a loop that checks its grads does, the loop variable `a`
    alive into the next step; (graphs captured, steady replays) after each step. The GPU twin runs it too."""
    history = []
    for step in range(steps):
        x = make_x(step)
        model.zero_grad(), ref.zero_grad()
        out, expected = cmodel(x), ref(x)
        close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        for a, b in zip(grads(model), grads(ref)):  # `a` stays alive into the next step
            close(a, b)
        s = stats()
        history.append((s["graphs_captured"], s["steady_replays"]))
    return history


def test_sync_fallback_beside_a_training_partition_whose_grad_the_loop_keeps(caplog):
    """The loop of tests/gpu's sync-fallback test, step by step: partition a holds an unclassified sync and runs
    eagerly from its failed capture on; b trains through one instance while the loop's last `a` (a grad of b's
    backward graph once it hands grads out to be stolen, from step 2) lives into the next step. Step 3 finds that
    graph held, runs eagerly once and copies its grads out from then on; steps 4 and 5 replay it: no second
    instance. (The H200 run of 2026-11-28 captured 4 graphs and replayed none by step 3: a second instance where
    this twin learns, not reproduced without a GPU.)"""
    from tests.test_runtime_traps import SYNCING_TAGS, Syncing, partition_name, tag_syncing

    ref, model = twins(Syncing)
    cmodel = compiled(tag_syncing(model), cuda_graph_modules=list(SYNCING_TAGS.values()), measure_benefit="off")
    with caplog.at_level(logging.WARNING, logger="cgcompile"), record_plans() as rec:
        history = train_keeping_a_grad(cmodel, model, ref, lambda step: batch(step, (3, 4))[0], assert_close)
    # (graphs captured, steady replays) after each step: b's forward and backward captured at step 1, replayed at
    # step 2, eager at step 3 (the kept grad), replayed at 4 and 5
    assert history == KEPT_GRAD_HISTORY, history
    (plan,) = rec.graphs
    assert [f["partition"] for f in stats()["eager_fallbacks"]] == [partition_name(plan, plan.partitions[0])]
    assert sum("runs eagerly" in r.getMessage() for r in caplog.records) == 1

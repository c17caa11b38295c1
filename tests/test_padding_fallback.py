"""A padded partition that falls back to eager gives its frame's padding up (runtime/frame/unpadded.py).

Run eagerly, a padded partition still computes every padded row; the frame is compiled again without
dynamic_padding from its next call. The emulate driver's timer is scripted (tests/test_benefit.py) so that the
padded partitions' replays do not pay and every other partition's do."""

import copy
import logging
import os

import torch
from expecttest import assert_expected_inline

import cgcompile
from cgcompile.backend import record_plans
from cgcompile.runtime.drivers.emulate import EmulateDriver
from cgcompile.runtime.drivers.timing import Timer
from tests.models import MODELS
from tests.padding_run import padding_options


class PaddedReplaysSlow(Timer):
    """Eager calls 1 ms; replays 2 ms for the partitions the recorded plans pad, 0.1 ms for every other."""

    def __init__(self, plans):
        super().__init__()
        self.plans = plans

    def measure(self, fn, args, partition, phase):
        padded = {g.runner_name(p) for g in self.plans for p in g.partitions if p.padding}
        seconds = 1e-3 if phase.startswith("eager") else (2e-3 if partition in padded else 1e-4)
        return fn(args), seconds


def test_a_padded_partition_that_does_not_pay_leaves_its_frame_unpadded(monkeypatch, caplog):
    """Four forwards, then one backward through all, every step. The switch falls on a forward after the first of
    its step, with forwards of the padded frame still waiting for their backward (its graphs released: they run
    eagerly); every step's gradients are eager's; the unpadded frame's graphs are captured and replayed."""
    spec = MODELS["moe_mask"]
    model = spec.make()
    reference = copy.deepcopy(model)
    switched_at = None
    with torch._dynamo.config.patch(spec.dynamo_flags()), record_plans() as rec, \
            caplog.at_level(logging.WARNING, logger="cgcompile"):
        monkeypatch.setattr(EmulateDriver, "timer", PaddedReplaysSlow(rec.graphs))
        compiled = torch.compile(model, backend="cudagraph_modules",
                                 options=padding_options("max", measure_benefit="on"))
        cgcompile.reset_stats()
        for step in range(8):
            batches = [spec.example_inputs(seed=10 * step + i)[0] for i in range(4)]
            outs = []
            for i, tokens in enumerate(batches):
                outs.append(compiled(tokens))
                if switched_at is None and cgcompile.stats()["padding_withdrawn"]:
                    switched_at = (step, i)
            sum(out.sum() for out in outs).backward()
            sum(reference(tokens).sum() for tokens in batches).backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                # padded sums add in another order than eager's (largest difference seen: 3.8e-6 over 4 batches)
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"{name}, step {step}")
            model.zero_grad(), reference.zero_grad()
    assert switched_at is not None and switched_at[1] > 0  # a padded frame's backward was pending at the switch
    padded_plan, unpadded_plan = [g for g in rec.graphs if g.training]
    padded = {padded_plan.runner_name(p) for p in padded_plan.partitions if p.padding}
    assert padded and not any(p.padding for p in unpadded_plan.partitions)
    assert "dynamic_shape" in {r.category for p in unpadded_plan.partitions for r in p.reasons}  # rows eager again
    st = cgcompile.stats()
    (withdrawn,) = st["padding_withdrawn"]
    assert withdrawn["partition"] in padded and withdrawn["reason"].startswith("not_profitable")
    (warning,) = [r.getMessage() for r in caplog.records if "without dynamic_padding" in r.getMessage()]
    # the graph index counts every frame this process compiled: shown as G
    warning = warning.replace(os.path.dirname(cgcompile.__file__), "cgcompile").replace(
        f"graph {padded_plan.index}", "graph G")
    assert_expected_inline(warning, """\
cgcompile: graph G: the padded partition graph G submod_0 (cgcompile/examples/moe.py:220) runs eagerly (not_profitable: its replay takes 4.000 ms per call, input copies included, its eager call 2.000 ms (forward+backward): not faster by 5%); its padded rows would cost more eagerly than the code as written, so the frame is compiled again without dynamic_padding""")
    # the unpadded frame's partitions are captured, pay, and are replayed again after their capture
    rows = [r for r in st["partitions"] if r["partition"].startswith(f"graph {unpadded_plan.index} ")]
    assert rows and all(r["fallback"] is None for r in rows) and max(r["replays"] for r in rows) > 4
    # and the padded frame holds no graph any more
    assert {g["label"].split(" submod")[0] for g in st["graphs"]} == {f"graph {unpadded_plan.index}"}

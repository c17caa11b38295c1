"""capture_sizes: a changing batch is padded to the next captured size and sliced back (emulate driver).

Exactness: the real rows of a padded call equal eager's; the padded rows only write cache rows past the real
batch. Overflow: a batch above the largest size runs eagerly, counted and logged once. A frame that mixes its
batch rows (softmax or mean over the batch) is refused with the op and its line in the plan.
"""

import copy
import logging
import re

import expecttest
import pytest
import torch
import torch.nn as nn

import cgcompile
from cgcompile.backend import record_plans
from tests.models import kv_gpt

OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": "block",
           "driver": "emulate", "cuda_graph_warmup_steps": 1}


def prefilled_twins():
    """A compiled-side and a reference KV model, both prefilled with the same 8 rows of 6 prompt tokens."""
    model = kv_gpt.build(max_batch=8).eval()
    (prompt,) = kv_gpt.example_inputs(batch=8, seq=6)
    kv_gpt.prefill(model, prompt)
    return model, copy.deepcopy(model)


def decode(compiled, model, reference, batches, start=6):
    """One step per batch size (non-increasing, so every row read was written by a real row of both models):
    compiled logits must equal eager's on the real rows."""
    pos = kv_gpt.positions(model.max_seq)
    (tokens,) = kv_gpt.example_inputs(batch=8, seq=len(batches), seed=1)
    with torch.no_grad():
        for step, batch in enumerate(batches):
            token, p = tokens[:batch, step:step + 1].clone(), pos[start + step]  # a fresh batch, as a server builds
            got, want = compiled(token, p), reference(token, p)
            assert got.shape == want.shape == (batch, 1, kv_gpt.VOCAB)  # sliced back to the real batch
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    last = batches[-1]
    for (name, cache), ref in zip(model.named_buffers(), reference.buffers()):
        if cache.dim() == 4:  # the real rows of every cache hold what eager wrote
            torch.testing.assert_close(cache[:last], ref[:last], rtol=1e-5, atol=1e-6, msg=name)


def test_changing_batch_replays_one_graph_per_capture_size():
    model, reference = prefilled_twins()
    compiled = torch.compile(model, backend="cudagraph_modules", dynamic=True,
                             options=dict(OPTIONS, capture_sizes=[2, 4, 8]))
    cgcompile.reset_stats()
    batches = [7, 7, 6, 5, 5, 3, 3, 3, 2, 2]
    with record_plans() as rec:
        decode(compiled, model, reference, batches)
    (graph,) = rec.graphs
    assert graph.batch_symbol is not None and graph.batch_padding_refused is None
    st = cgcompile.stats()
    # sizes 8 (for 7, 6, 5), 4 (for 3) and 2: one graph each, after one warmup call per size
    assert st["graphs_captured"] == 3 and st["capture_size_overflows"] == 0 and st["eager_fallbacks"] == []
    assert st["steady_replays"] == len(batches) - 3 - 3  # after the warmup and the capture call of each size


def test_without_capture_sizes_every_batch_size_is_its_own_graph():
    model, reference = prefilled_twins()
    compiled = torch.compile(model, backend="cudagraph_modules", dynamic=True, options=OPTIONS)
    cgcompile.reset_stats()
    decode(compiled, model, reference, [7, 7, 6, 6, 5, 5])
    assert cgcompile.stats()["graphs_captured"] == 3


def test_batch_above_the_largest_size_runs_eagerly_counted_and_logged_once(caplog):
    model, reference = prefilled_twins()
    compiled = torch.compile(model, backend="cudagraph_modules", dynamic=True,
                             options=dict(OPTIONS, capture_sizes=[2, 4]))
    cgcompile.reset_stats()
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        decode(compiled, model, reference, [6, 6, 5, 4, 4, 3])
    st = cgcompile.stats()
    assert st["capture_size_overflows"] == 3
    assert st["graphs_captured"] == 1  # size 4 only: 4 and 3 pad to it
    overflow = [r.getMessage() for r in caplog.records if "larger than the largest capture size" in r.getMessage()]
    assert len(overflow) == 1 and "batch 6" in overflow[0] and "capture size 4" in overflow[0]


class BatchSoftmax(nn.Module):
    """Normalizes across the batch: row i's output depends on every row, so padding would change it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.softmax(self.lin(x), dim=0)


class BatchCentered(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y - y.mean(0)


class BatchFlattened(nn.Module):
    """Returns the batch folded into another dimension: padded rows could not be sliced back off."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).flatten()


@pytest.mark.parametrize("cls, op", [(BatchSoftmax, "softmax"), (BatchCentered, "mean")])
def test_rows_mixed_across_the_batch_are_refused_and_still_exact(cls, op):
    torch.manual_seed(0)
    model = cls()
    compiled = torch.compile(model, backend="cudagraph_modules", dynamic=True,
                             options={"driver": "emulate", "cuda_graph_warmup_steps": 1, "capture_sizes": [4, 8],
                                      "min_partition_ops": 1})
    cgcompile.reset_stats()
    with torch.no_grad(), record_plans() as rec:
        for batch in (3, 5, 3, 5, 6):
            x = torch.randn(batch, 4)
            torch.testing.assert_close(compiled(x), model(x))  # unpadded: exact
    refused = [g.batch_padding_refused for g in rec.graphs if g.batch_symbol is not None]
    assert refused and refused[0].category == "not_paddable" and op in refused[0].detail
    assert cgcompile.stats()["capture_size_overflows"] == 0


def last_line(plan) -> str:
    """The plan's capture_sizes line, with Dynamo's symbol number and our line numbers made stable."""
    line = re.sub(r"\bs\d+\b", "sN", str(plan).splitlines()[-1])
    return re.sub(r"(\.py):\d+", r"\1:LINE", line)


def refusal_line(model) -> str:
    """The capture_sizes line of explain() for a batch of 3 rows marked dynamic."""
    torch._dynamo.reset()
    x = torch.randn(3, 4)
    torch._dynamo.mark_dynamic(x, 0)
    return last_line(cgcompile.explain(model, x, options={"driver": "emulate", "capture_sizes": [4, 8]}))


class TestCaptureSizesWording(expecttest.TestCase):
    def test_plan_says_why_padding_is_refused(self):
        self.assertExpectedInline(refusal_line(BatchSoftmax()), """\
capture_sizes [4, 8]: not applied, one graph per batch size: not_paddable: torch.softmax at \
test_capture_sizes.py:LINE: softmax works across the sN rows (dim=0) (normalize over another dimension, or leave \
this region eager)""")

    def test_a_refused_output_names_the_op_and_line_producing_it(self):
        self.assertExpectedInline(refusal_line(BatchFlattened()), """\
capture_sizes [4, 8]: not applied, one graph per batch size: not_paddable: output at test_capture_sizes.py:LINE: \
output flatten has a dimension mixing the batch sN with another size (return the batch as its own dimension)""")

    def test_plan_says_padding_is_applied(self):
        torch._dynamo.reset()
        model = kv_gpt.build(max_batch=8).eval()
        token = torch.zeros(3, 1, dtype=torch.long)
        torch._dynamo.mark_dynamic(token, 0)
        with torch.no_grad():
            plan = cgcompile.explain(model, token, torch.tensor([6]), options=dict(OPTIONS, capture_sizes=[2, 4, 8]))
        self.assertExpectedInline(last_line(plan), """\
capture_sizes [2, 4, 8]: batch sN is padded to the next size, outputs sliced back; larger batches run eagerly""")


class TestBatchOfOne(expecttest.TestCase):
    def test_a_batch_of_one_is_its_own_frame_and_its_plan_says_how_to_pad_it(self):
        """Dynamo traces a batch of 1 as a static frame of its own: capture_sizes cannot pad it, so it captures its
        own graphs (4 for 3 declared sizes); the frame's plan says so and how to serve it from the smallest size."""
        from cgcompile.diagnostics import capture_sizes_line

        model, reference = prefilled_twins()
        config = dict(OPTIONS, capture_sizes=[2, 4, 8])
        compiled = torch.compile(model, backend="cudagraph_modules", dynamic=True, options=config)
        cgcompile.reset_stats()
        with record_plans() as rec:
            decode(compiled, model, reference, [3, 3, 3, 2, 2, 2, 1, 1, 1])
        padded, single = rec.graphs
        assert padded.batch_symbol is not None and not padded.static_batch_of_one
        assert single.batch_symbol is None and single.static_batch_of_one
        assert cgcompile.stats()["graphs_captured"] == 3  # sizes 4 and 2 padded, the batch of 1 its own
        self.assertExpectedInline(capture_sizes_line(single, cgcompile.CudaGraphConfig.from_options(config)), """\
capture_sizes [2, 4, 8]: not applied: this frame has a static batch of 1 (Dynamo traces sizes 0 and 1 as frames of their own), so it captures graphs of its own; to serve a batch of 1 from the smallest size, pad it to 2 rows before the call (docs/guides/serving.md)""")

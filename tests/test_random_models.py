"""Randomized parity: small models drawn from the patterns real models use around partition boundaries
(no_grad / enable_grad / autocast blocks, associative_scan, random draws, in-place updates of activations and
buffers, host reads, eager regions, tags on random blocks) train through the backend exactly like eager.

Each example builds a stack of blocks, compiles one copy with the emulate driver and runs an identical copy
eagerly, both from the same seeds, for a few training steps and one no-grad call; losses, every gradient,
every buffer and the thread's global state after each call must match. This is the test that would have caught
grad mode leaking out of a partition, a vmap level cut in two, a capture that draws random numbers and
overload-blind op tags.

CI runs a fixed, derandomized set of examples (CGCOMPILE_FUZZ_EXAMPLES, default 120: under a second each);
`make test-nightly` runs many more with fresh randomness.
"""

from __future__ import annotations

import os
from typing import List, Sequence, Tuple

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._higher_order_ops.associative_scan import associative_scan

import cgcompile
from cgcompile.backend import record_plans
from cgcompile.runtime import live_runtimes
from cgcompile.runtime.drivers.thread_state import GlobalState

D = 8
NIGHTLY = os.environ.get("CGCOMPILE_FUZZ_NIGHTLY") == "1"
EXAMPLES = int(os.environ.get("CGCOMPILE_FUZZ_EXAMPLES", "1000" if NIGHTLY else "120"))


class Block(nn.Module):
    """One block: a linear layer, then the pattern it was drawn with, then a residual add."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern
        self.lin = nn.Linear(D, D)
        self.register_buffer("ema", torch.zeros(D))

    def forward(self, x):
        h = self.lin(x)
        p = self.pattern
        if p == "no_grad_stats":  # statistics in a no_grad block, after and before differentiable work
            flat = h.reshape(-1, D)
            with torch.no_grad():
                scale = flat.abs().mean() + 1
            h = flat.reshape(x.shape) / scale
        elif p == "no_grad_host_read":  # the block's statistics go through a host read (an eager island)
            with torch.no_grad():
                positive = (h > 0).sum().item()
                scale = h.abs().mean() + positive / h.numel()
            h = torch.relu(h) * scale
        elif p == "view_then_no_grad_host_read":  # a view of the block's input, then the block above on it
            flat = x.reshape(-1, D)
            with torch.no_grad():
                positive = (flat > 0).sum().item()
                scale = flat.abs().mean() + positive / flat.numel()
            h = (self.lin(torch.relu(flat)) * scale).reshape(x.shape)
        elif p == "enable_grad_in_no_grad":  # a differentiable island inside a no_grad block
            with torch.no_grad():
                stat = h.detach().square().mean()
                with torch.enable_grad():
                    h = torch.tanh(h)
            h = h + stat
        elif p == "autocast":  # lower-precision work inside an autocast block
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.lin(h)
            h = h.float()
        elif p == "scan":  # a state-space style recurrence (vmap levels in the graph)
            h = associative_scan(lambda a, b: a * b, torch.sigmoid(h), dim=1, combine_mode="generic")
        elif p == "noise":  # router-style noise and dropout: every training call draws
            if self.training:
                h = h - torch.empty_like(h).exponential_().log()
            h = nn.functional.dropout(h, 0.25, self.training)
        elif p == "inplace":  # in-place updates of an activation and of a buffer
            h = h * 1.0
            h.mul_(0.5).add_(1)
            with torch.no_grad():
                self.ema.mul_(0.9).add_(h.mean(dim=(0, 1)) * 0.1)
            h = h + self.ema
        elif p == "repeat":  # static-shape repeat_interleave (an int repeat)
            h = h.repeat_interleave(2, dim=-1)[..., ::2]
        return x + h


PATTERNS = ("plain", "no_grad_stats", "no_grad_host_read", "view_then_no_grad_host_read", "enable_grad_in_no_grad", "autocast", "scan",
            "noise", "inplace", "repeat")
TAGS = (None, "attn", "mlp", "custom")


class Stack(nn.Module):
    def __init__(self, patterns: Sequence[str]):
        super().__init__()
        self.blocks = nn.ModuleList([Block(p) for p in patterns])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def build(layout: Sequence[Tuple[str, str, bool]]) -> Tuple[Stack, Stack]:
    """The compiled model (tags and eager regions on its block instances) and its eager twin."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Stack([p for p, _, _ in layout])
    reference = Stack([p for p, _, _ in layout])
    reference.load_state_dict(model.state_dict())
    for block, (_, tag, eager) in zip(model.blocks, layout):
        if tag is not None:
            cgcompile.tag(tag)(block)
        if eager:
            cgcompile.eager_region(block)
    return model, reference


def run_pair(model: Stack, reference: Stack, options: dict, steps: int, seed: int, no_grad_call: bool) -> None:
    """`steps` training steps (warmup, capture, replays), then optionally one call under no_grad in eval mode
    (a second Dynamo graph, so only some examples pay for it)."""
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    for step in range(steps + no_grad_call):
        training = step < steps
        model.train(training)
        reference.train(training)
        x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(seed + step))
        with torch.set_grad_enabled(training):
            torch.manual_seed(seed + 1000 + step)
            loss = compiled(x)
            state_after_compiled = GlobalState.now()
            torch.manual_seed(seed + 1000 + step)
            expected = reference(x)
            assert state_after_compiled == GlobalState.now(), f"step {step}: global state differs from eager's"
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6, msg=f"loss at step {step}")
        if training:
            loss.backward()
            expected.backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert p.grad is not None, f"{name}: no gradient at step {step}"
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{name} at step {step}")
            model.zero_grad()
            reference.zero_grad()
        for (name, b), c in zip(model.named_buffers(), reference.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=f"buffer {name} at step {step}")


# (pattern, tag, eager_region) per block; one block in four is an eager region
layouts = st.lists(st.tuples(st.sampled_from(PATTERNS), st.sampled_from(TAGS), st.sampled_from((False,) * 3 + (True,))),
                   min_size=1, max_size=4)


def _select(layout: List[Tuple[str, str, bool]], data) -> List[str]:
    present = sorted({tag for _, tag, _ in layout if tag is not None})
    if not present:
        return []
    return data.draw(st.lists(st.sampled_from(present), unique=True, max_size=len(present)), label="modules")


@pytest.mark.timeout(3600 if NIGHTLY else 600)
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not NIGHTLY,
          suppress_health_check=list(HealthCheck))
@given(layout=layouts, data=st.data(), min_ops=st.integers(1, 3), strict_modules=st.booleans(),
       scalar_outputs=st.booleans(), no_grad_call=st.sampled_from((False, False, True)), seed=st.integers(0, 2**16))
def test_random_models_train_like_eager(layout, data, min_ops, strict_modules, scalar_outputs, no_grad_call, seed):
    torch._dynamo.reset()
    cgcompile.reset_stats()
    model, reference = build(layout)
    options = {"driver": "emulate", "cuda_graph_warmup_steps": 1, "min_partition_ops": min_ops,
               "strict_modules": strict_modules, "cuda_graph_modules": _select(layout, data)}
    with torch._dynamo.config.patch(capture_scalar_outputs=scalar_outputs), record_plans() as rec:
        run_pair(model, reference, options, steps=3, seed=seed, no_grad_call=no_grad_call)
    stats = cgcompile.stats()
    assert stats["eager_fallbacks"] == [], stats["eager_fallbacks"]
    # every island says why, with the user's line, and only the patterns that need one make one
    explained = {"eager_region", "untagged", "not_selected", "too_small"} | (
        {"host_sync", "dynamic_shape"} if any(p.endswith("host_read") for p, _, _ in layout)
                                    else set())
    for graph in rec.graphs:
        for partition in graph.partitions:
            if not partition.captured:
                assert partition.reasons and all(r.location for r in partition.reasons), partition
                assert {r.category for r in partition.reasons} <= explained, partition
    if any(p.captured for graph in rec.graphs if graph.training for p in graph.partitions):
        assert stats["graphs_captured"] > 0 and stats["steady_replays"] > 0, stats


def test_every_pattern_with_sizes_that_vary_trains_like_eager():
    """Every pattern above in one stack, at the default warmup, with a sequence length that varies: the partitions
    are traced with a symbolic size, so each size runs uncompiled at its first call and compiles when it comes again
    (runtime/local/runner.py). Loss, gradients, buffers and global state match eager at every step, and the sizes
    that repeat are captured and replayed; the one that comes once never compiles."""
    layout = [(p, None, False) for p in PATTERNS]
    # Dynamo's reset leaves the compiled functions of resumed frames in this module's globals (torch's own
    # backends alike), and with them earlier tests' runtimes, released: only this test's runtimes are checked
    earlier = live_runtimes()
    model, reference = build(layout)
    compiled = torch.compile(model, backend="cudagraph_modules", options={"driver": "emulate"})
    lengths = [5, 7] * 5 + [9, 5, 7]
    for step, length in enumerate(lengths):
        x = torch.randn(2, length, D, generator=torch.Generator().manual_seed(step))
        torch._dynamo.mark_dynamic(x, 1)
        torch.manual_seed(1000 + step)
        loss = compiled(x)
        state_after_compiled = GlobalState.now()
        torch.manual_seed(1000 + step)
        expected = reference(x)
        assert state_after_compiled == GlobalState.now(), f"step {step}: global state differs from eager's"
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6, msg=f"loss at step {step}")
        loss.backward()
        expected.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{name} at step {step}")
        model.zero_grad()
        reference.zero_grad()
        for (name, b), c in zip(model.named_buffers(), reference.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=f"buffer {name} at step {step}")
    stats = cgcompile.stats()
    assert stats["eager_fallbacks"] == [], stats["eager_fallbacks"]
    sized = [r for rt in live_runtimes() if not any(rt is e for e in earlier) for r in rt.runners() if r.sized]
    assert sized and all(r.bank_size() <= 2 for r in sized), [(r.name, r.bank_size()) for r in sized]  # never 9
    assert any(r.bank_counters().sizes == 3 and r.bank_size() == 2 for r in sized)  # 9 seen, run uncompiled
    assert stats["steady_replays"] > 0 and all(r.bank_counters().replays > 0 for r in sized), stats

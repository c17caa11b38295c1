"""Inputs and outputs of any layout through captured partitions (emulate driver; the CUDA twin is in
tests/gpu/test_gpu_layouts.py): a partition returning an expanded (stride-0) view, a stride-0 input (HF
decode's `cache_position.expand(batch, 1)`), non-contiguous, storage-offset and empty tensors. Each replays
like eager, with graphs captured and replayed and no eager fallback."""

import re

import expecttest
import pytest
import torch

import cgcompile
from cgcompile.runtime.layout import broadcast_core, copy_into, static_copy, uncopyable_reason

OPTIONS = {"driver": "emulate", "cuda_graph_warmup_steps": 1}


def scale_rows(pos, x):
    return (pos[:, None].float() * 0.5 + 1).expand(-1, 4), x * 2  # the first output: a stride-0 view


def add_positions(x, position_ids):
    return torch.sin(x + position_ids).cos() * 3


CASES = {
    "expanded output": (scale_rows, lambda step: (torch.arange(3) + step, torch.randn(3, 4))),
    "stride-0 input": (add_positions, lambda step: (torch.randn(2, 1), torch.tensor([[5 + step]]).expand(2, 1))),
    "expanded 2-d input": (add_positions, lambda step: (torch.randn(3, 4), torch.randn(4).expand(3, 4))),
    "transposed input": (add_positions, lambda step: (torch.randn(4, 3).T, torch.randn(3, 4))),
    "storage offset": (add_positions, lambda step: (torch.randn(10)[2:6], torch.randn(4))),
    "empty input": (add_positions, lambda step: (torch.randn(0, 4), torch.randn(0, 4))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_any_layout_replays_like_eager(case):
    fn, make = CASES[case]
    compiled = torch.compile(fn, backend="cudagraph_modules", options=OPTIONS)
    cgcompile.reset_stats()
    with torch.no_grad():
        for step in range(4):
            args = make(step)
            got, want = compiled(*args), fn(*args)
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            for g, w in zip(got, want):
                assert g.shape == w.shape and torch.equal(g, w), case
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [], st["eager_fallbacks"]
    assert st["graphs_captured"] >= 1 and st["replays"] >= 2, case


def test_expanded_static_buffer_keeps_its_strides_and_takes_new_values_once():
    src = torch.tensor([[1.0], [2.0]]).expand(2, 3)
    buf = static_copy(src)
    assert buf.stride() == src.stride() and torch.equal(buf, src)
    copy_into(buf, torch.tensor([[7.0], [8.0]]).expand(2, 3))
    assert torch.equal(buf, torch.tensor([[7.0] * 3, [8.0] * 3])) and broadcast_core(buf).shape == (2, 1)
    with pytest.raises(RuntimeError, match="repeats along its stride-0"):
        copy_into(buf, torch.randn(2, 3))  # values that differ along the repeated dimension cannot fit


def test_only_a_true_self_overlap_is_refused_with_a_reason():
    window = torch.arange(6.0).as_strided((3, 3), (1, 1))  # sliding windows share elements
    assert "as_strided" in uncopyable_reason(window)
    assert uncopyable_reason(torch.randn(4).expand(3, 4)) is None


class TestUncopyableInputWording(expecttest.TestCase):
    def test_a_failed_capture_names_the_users_argument_and_line(self):
        """A sliding window cannot have a static buffer: the partition falls back to eager (still correct),
        and the logged reason names the argument and the line that reads it, not an input index."""
        compiled = torch.compile(add_positions, backend="cudagraph_modules", options=OPTIONS)
        cgcompile.reset_stats()
        for step in range(3):
            x = torch.randn(3, 3, requires_grad=True)
            window = torch.arange(6.0 + step).as_strided((3, 3), (1, 1))
            got, want = compiled(x, window), add_positions(x, window)
            assert torch.equal(got, want)
            got.sum().backward()
        [fallback] = cgcompile.stats()["eager_fallbacks"]
        reason = re.sub(r"test_runtime_layouts.py:\d+", "test_runtime_layouts.py:N", fallback["reason"])
        self.assertExpectedInline(reason, """\
capturing its forward graph failed: CaptureError: argument `position_ids` (read at test_runtime_layouts.py:N) \
cannot be copied into a static buffer: its memory overlaps itself (strides (1, 1) for shape (3, 3), e.g. from \
as_strided or unfold), which no static buffer can mirror; pass .contiguous() there""")

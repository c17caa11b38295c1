"""Inputs and outputs of any layout through captured partitions (emulate driver; the CUDA twin is in
tests/gpu/test_gpu_layouts.py): a partition returning an expanded (stride-0) view, a stride-0 input (HF
decode's `cache_position.expand(batch, 1)`), non-contiguous, storage-offset and empty tensors. Each replays
like eager, with graphs captured and replayed and no eager fallback."""

import re

import expecttest
import pytest
import torch

import cgcompile
from cgcompile.runtime.tensors import broadcast_core, copy_into, static_copy, uncopyable_reason
from tests.layout_cases import CASES, add_positions, on_device

OPTIONS = {"driver": "emulate", "cuda_graph_warmup_steps": 1}


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
    assert st["graphs_captured"] >= 1 and st["steady_replays"] >= 1, case


@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_reach_another_device_with_the_layout_they_name(case):
    """The GPU twin moves each case with on_device; `.cuda()` would drop the storage offset (and copy a stride-0
    input out in full), testing a plain contiguous input instead. The meta device shows the layout on the CPU."""
    for arg in CASES[case][1](0):
        moved = on_device(arg, "meta")
        assert moved.device.type == "meta"
        assert (moved.shape, moved.stride(), moved.storage_offset()) == (arg.shape, arg.stride(),
                                                                          arg.storage_offset())
    if case == "storage offset":
        assert CASES[case][1](0)[0].storage_offset() == 2


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
        reason = re.sub(r"layout_cases.py:\d+", "layout_cases.py:N", fallback["reason"])
        self.assertExpectedInline(reason, """\
capturing its forward graph failed: CaptureError: argument `position_ids` (read at layout_cases.py:N) \
cannot be copied into a static buffer: its memory overlaps itself (strides (1, 1) for shape (3, 3), e.g. from \
as_strided or unfold), which no static buffer can mirror; pass .contiguous() there""")

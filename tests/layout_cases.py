"""Inputs and outputs of every layout a partition must replay like eager (expanded, stride-0, transposed,
storage-offset, empty), shared by tests/test_runtime_layouts.py (emulate) and tests/gpu/test_gpu_layouts.py
(CUDA). Kept apart from those modules so the GPU twin imports no optional test package (expecttest)."""

import torch


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


def on_device(t: torch.Tensor, device) -> torch.Tensor:
    """t on `device` with its sizes, strides and storage offset: the whole storage moves, then the same view is
    taken of it. `Tensor.to`/`.cuda()` copy only the viewed elements, which drops a storage offset and turns
    a stride-0 view into a full copy, so the case would no longer test the layout it names."""
    whole = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return whole.to(device).as_strided(t.shape, t.stride(), t.storage_offset())

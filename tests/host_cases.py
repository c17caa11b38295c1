"""A model that takes a per-call scale as a 0-d tensor, shared by tests/test_host_tensors.py (its plan on the meta
device) and tests/gpu/test_gpu_host_tensors.py (CUDA). Kept apart so the GPU twin imports no optional test package
(expecttest)."""

import torch
import torch.nn as nn


class Scaled(nn.Module):
    """A per-call scale passed as a 0-d tensor, as a temperature or a step count often is."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, scale):
        doubled = scale * 2
        h = self.first(x) * torch.tensor(3.0)  # a constant: the same at every call, exact inside a graph
        h = self.second(h) * doubled
        return h.relu() + scale.dim() + scale.shape.numel()  # metadata reads: no host data read

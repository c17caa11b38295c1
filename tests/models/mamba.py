"""A tiny Mamba-like model: embedding, N x (RMSNorm -> Mamba ("mamba") -> residual), RMSNorm, LM head.

The Mamba block is in_proj -> depthwise causal conv1d -> SiLU -> selective scan -> gate -> out_proj. The scan
is a Python loop over the (short) sequence, so every shape is static and the whole block is capturable.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import cgcompile

from ._common import VOCAB, lm_loss, seeded, token_inputs

D_MODEL = 16


class MambaRMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@cgcompile.tag("mamba")
class Mamba(nn.Module):
    def __init__(self, d_model: int, d_state: int = 4, d_conv: int = 4, expand: int = 2, dt_rank: int | None = None):
        super().__init__()
        d_inner = expand * d_model
        self.d_inner, self.d_state = d_inner, d_state
        self.dt_rank = dt_rank or max(1, math.ceil(d_model / 16))
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        xs = self.conv1d(xs.transpose(1, 2))[..., :length].transpose(1, 2)   # causal: drop the right padding
        xs = F.silu(xs)
        dt, bmat, cmat = self.x_proj(xs).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))                                      # (b, L, d_inner)
        a = -torch.exp(self.A_log)                                             # (d_inner, d_state)
        decay = torch.exp(dt.unsqueeze(-1) * a)                                # (b, L, d_inner, d_state)
        drive = dt.unsqueeze(-1) * bmat.unsqueeze(2) * xs.unsqueeze(-1)        # (b, L, d_inner, d_state)
        state = torch.zeros(b, self.d_inner, self.d_state, dtype=x.dtype, device=x.device)
        ys = []
        for t in range(length):
            state = decay[:, t] * state + drive[:, t]
            ys.append((state * cmat[:, t].unsqueeze(1)).sum(-1))
        y = torch.stack(ys, dim=1) + xs * self.D
        return self.out_proj(y * F.silu(z))


class MambaLayer(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.norm = MambaRMSNorm(d_model)
        self.mamba = Mamba(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mamba(self.norm(x))


class MambaLM(nn.Module):
    def __init__(self, num_layers: int = 2, d_model: int = D_MODEL, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(MambaLayer(d_model) for _ in range(num_layers))
        self.norm = MambaRMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(num_layers: int = 2, seed: int = 0, *, d_model: int = D_MODEL, **kw) -> MambaLM:
    with seeded(seed):
        return MambaLM(num_layers=num_layers, d_model=d_model, **kw)


def example_inputs(batch: int = 2, seq: int = 8, seed: int = 0, device=None) -> tuple:
    return token_inputs(batch, seq, seed, VOCAB, device)


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(tokens), tokens)

"""Helpers shared by the tiny test models (functions only: no module classes are shared between models,
so a class-decorator tag on one model can never leak into another)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

VOCAB = 64
MAX_SEQ = 32


@contextlib.contextmanager
def seeded(seed: int):
    """Run parameter initialisation under `seed` without disturbing the caller's global CPU RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def token_inputs(batch: int = 2, seq: int = 8, seed: int = 0, vocab: int = VOCAB, device=None) -> tuple:
    """Deterministic int64 token ids of shape (batch, seq), as a 1-tuple (the model's positional args)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.int64)
    return (tokens.to(device) if device is not None else tokens,)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: logits at position t predict token t+1."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), tokens[:, 1:].reshape(-1))

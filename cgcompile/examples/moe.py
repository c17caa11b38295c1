"""The demo's model (`python -m cgcompile.demo`), shipped with the package so the demo runs from an installed
wheel; the tests use it too (tests/models/moe.py): a tiny Mixtral-like MoE transformer with data-dependent
token dispatch. Built in code, no downloads. `CUDA_GRAPH_MODULES` are the tags the demo selects.

Block: RMSNorm -> SelfAttention ("attn") -> residual -> RMSNorm -> MoE ("moe") -> residual.
MoE: Router ("moe_router": linear -> softmax -> top-2 -> renormalise) and MoEPreprocess ("moe_preprocess":
routing mask, combine weights and tokens-per-expert counts) have static shapes only. The dispatch to the
(untagged) SwiGLU experts, written in MoE.forward, is data-dependent, in one of two styles:

- dispatch="mask": per expert, torch.nonzero on the routing mask, gather, expert, index_add_ (unbacked sizes).
- dispatch="sort": torch.bincount of the expert ids, .tolist() (host sync), argsort, torch.split, experts,
  combine with index_add_. bincount's output *length* is data-dependent, so with
  torch._dynamo.config.capture_dynamic_output_shape_ops=True Dynamo cannot trace the .tolist() that follows
  (GuardOnDataDependentSymNode, a hard error, not a graph break); build(sort_counts="preprocess") takes the
  counts from MoEPreprocess instead (static length E), leaving .tolist() as the only data-dependent origin.

Both compute out[t] = sum_k w[t, k] * expert_{id[t, k]}(x[t]) and differ only in summation order.
`row_mixing=True` (mask dispatch) subtracts each expert's mean over its selected tokens: the selected rows then
mix, so dynamic_padding cannot pad them exactly (the non-paddable variant).
Each data-dependent line carries a trailing marker comment naming the dispatch style and the op kind, so the
tests (tests/models/moe.py, `dispatch_lines()`) can find the exact line numbers a plan should cite.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import cgcompile

VOCAB = 64
MAX_SEQ = 32
D_MODEL = 32
N_HEADS = 4
NUM_EXPERTS = 4
TOP_K = 2
DISPATCH_STYLES = ("mask", "sort")
CUDA_GRAPH_MODULES = ("attn", "moe_router", "moe_preprocess")
SORT_COUNTS = ("bincount", "preprocess")



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


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@cgcompile.tag("attn")
class SelfAttention(nn.Module):
    """Causal self-attention, no biases (Mixtral style), via scaled_dot_product_attention."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        hd = d // self.n_heads
        q = self.q_proj(x).view(b, s, self.n_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_heads, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, d))


@cgcompile.tag("moe_router")
class Router(nn.Module):
    """Top-k softmax router. Returns (weights (T, k) summing to 1 per token, expert ids (T, k) int64)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d_model, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(x), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


@cgcompile.tag("moe_preprocess")
class MoEPreprocess(nn.Module):
    """Routing metadata with static shapes: one-hot mask (T, E) int64, dense combine weights (T, E) and
    tokens-per-expert counts (E,). Built with scatter (not one_hot, whose CPU kernel reads min() on the host)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def forward(self, weights: torch.Tensor, ids: torch.Tensor):
        t = ids.shape[0]
        mask = torch.zeros(t, self.num_experts, dtype=torch.int64, device=ids.device).scatter(1, ids, 1)
        combine = torch.zeros(t, self.num_experts, dtype=weights.dtype, device=weights.device).scatter(1, ids, weights)
        counts = mask.sum(0)
        return mask, combine, counts


class Expert(nn.Module):
    """SwiGLU feed-forward; runs on a data-dependent number of tokens, so it is left untagged."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@cgcompile.tag("moe")
class MoE(nn.Module):
    def __init__(self, d_model: int, num_experts: int = NUM_EXPERTS, top_k: int = TOP_K,
                 hidden: int | None = None, dispatch: str = "mask", sort_counts: str = "bincount",
                 row_mixing: bool = False):
        super().__init__()
        if dispatch not in DISPATCH_STYLES:
            raise ValueError(f"dispatch must be one of {DISPATCH_STYLES}, got {dispatch!r}")
        if sort_counts not in SORT_COUNTS:
            raise ValueError(f"sort_counts must be one of {SORT_COUNTS}, got {sort_counts!r}")
        self.dispatch = dispatch
        self.sort_counts = sort_counts
        self.row_mixing = row_mixing
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = Router(d_model, num_experts, top_k)
        self.preprocess = MoEPreprocess(num_experts)
        self.experts = nn.ModuleList(Expert(d_model, hidden or 2 * d_model) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = x.reshape(b * s, d)
        weights, ids = self.router(h)
        mask, combine, counts = self.preprocess(weights, ids)
        if self.dispatch == "mask":
            out = torch.zeros_like(h)
            for e, expert in enumerate(self.experts):
                idx = torch.nonzero(mask[:, e]).squeeze(-1)  # DISPATCH(mask): nonzero
                y = expert(h[idx])  # DISPATCH(mask): gather
                if self.row_mixing:
                    y = y - y.mean(0)  # ROW_MIXING: mean
                out.index_add_(0, idx, y * combine[idx, e].unsqueeze(-1))  # DISPATCH(mask): combine
        else:
            flat_ids = ids.reshape(-1)
            if self.sort_counts == "bincount":
                expert_counts = torch.bincount(flat_ids, minlength=self.num_experts)  # DISPATCH(sort): bincount
            else:
                expert_counts = counts  # tokens per expert from MoEPreprocess: static shape (E,)
            splits = expert_counts.tolist()  # DISPATCH(sort): tolist
            order = torch.argsort(flat_ids, stable=True)
            token_idx = order // self.top_k
            chunks = torch.split(h[token_idx], splits)  # DISPATCH(sort): split
            y = torch.cat([expert(c) for expert, c in zip(self.experts, chunks)])
            w = combine[token_idx, flat_ids[order]]
            out = torch.zeros_like(h).index_add_(0, token_idx, y * w.unsqueeze(-1))  # DISPATCH(sort): combine
        return out.reshape(b, s, d)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dispatch: str, num_experts: int, top_k: int,
                 sort_counts: str = "bincount", row_mixing: bool = False):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads)
        self.moe_norm = RMSNorm(d_model)
        self.moe = MoE(d_model, num_experts, top_k, dispatch=dispatch, sort_counts=sort_counts, row_mixing=row_mixing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        x = x + self.moe(self.moe_norm(x))
        return x


class MoETransformer(nn.Module):
    def __init__(self, num_layers: int = 2, d_model: int = D_MODEL, n_heads: int = N_HEADS,
                 vocab: int = VOCAB, dispatch: str = "mask", num_experts: int = NUM_EXPERTS, top_k: int = TOP_K,
                 sort_counts: str = "bincount", row_mixing: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads, dispatch, num_experts, top_k, sort_counts, row_mixing)
                                    for _ in range(num_layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(num_layers: int = 2, seed: int = 0, *, dispatch: str = "mask", d_model: int = D_MODEL,
          n_heads: int = N_HEADS, num_experts: int = NUM_EXPERTS, top_k: int = TOP_K,
          sort_counts: str = "bincount", **kw) -> MoETransformer:
    """Deterministic tiny MoE model. The parameters depend only on the seed and sizes, not on `dispatch` or
    `sort_counts`, so every dispatch variant built with the same seed computes the same function.
    `sort_counts` ("bincount" | "preprocess") only matters for dispatch="sort" (see the module docstring)."""
    with seeded(seed):
        return MoETransformer(num_layers=num_layers, d_model=d_model, n_heads=n_heads, dispatch=dispatch,
                              num_experts=num_experts, top_k=top_k, sort_counts=sort_counts, **kw)


def example_inputs(batch: int = 2, seq: int = 8, seed: int = 0, device=None) -> tuple:
    return token_inputs(batch, seq, seed, VOCAB, device)


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(tokens), tokens)

"""An expert-parallel (EP) MoE transformer on torch.distributed, in the style of Megatron's all-to-all dispatcher.

Every rank of the EP group holds the same attention / router weights and `num_local_experts` of the
`world_size * num_local_experts` experts (rank r owns experts r*L ... r*L+L-1), and feeds its own tokens.

Layer: RMSNorm -> SelfAttention ("attn") -> residual -> RMSNorm -> EPMoE ("moe") -> residual.
EPMoE:
- EPRouter ("moe_router"): linear -> softmax -> top-k -> renormalise; tokens per expert; a Switch-style
  load-balancing loss whose token fractions are summed over the EP group with `dist.all_reduce` (fixed shape).
- EPPreprocess ("moe_preprocess"): the permutation that groups the (token, k) slots by expert, and the exchange
  of the per-expert counts with `dist.all_to_all_single` (fixed shape: E counts, equal splits).
- dispatch (untagged, in EPMoE.forward): `.tolist()` of the counts (host sync) -> the split sizes of the
  token all-to-all -> sort the received chunks by local expert -> local experts -> unsort -> reverse all-to-all
  -> weighted combine. The token all-to-alls have data-dependent split sizes: they cannot be captured.

Which collective APIs (checked on torch 2.13):
- Dynamo rewrites the c10d in-place collectives (`dist.all_reduce`, `dist.all_to_all_single`, ...) into
  functional collectives through `torch.distributed._functional_collectives.traceable_collective_remaps`
  (`_c10d_functional.all_reduce` + `wait_tensor` + `copy_` into the given tensor). In eager mode the c10d
  ops are not differentiable, while the remapped functional ops are (torch 2.13 registers autograd for
  `_c10d_functional.all_reduce / all_to_all_single / ...`): with c10d in-place calls on tensors that need
  gradients, eager and compiled backward would differ. So the model uses c10d in-place calls only on integer
  counts (no gradient), and `funcol.all_to_all_single_autograd` for the tokens, in eager and compiled alike.
- `torch.distributed.nn.functional.*` (the old autograd-aware wrappers) raise under torch.compile and are
  deprecated in favour of the functional collectives.

The dispatch lines carry trailing markers `# EP(<kind>)`, so `ep_lines()` gives tests the line numbers a plan
should cite. `build(group=None, num_local_experts=W * L)` is the same math on one process holding every
expert, with no collectives (the reference the EP group must reproduce).
"""

from __future__ import annotations

import linecache
import re

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cgcompile

from ._common import VOCAB, lm_loss, seeded, token_inputs
from .moe import Expert, RMSNorm, SelfAttention

D_MODEL = 32
N_HEADS = 4
NUM_LOCAL_EXPERTS = 2
TOP_K = 2
AUX_LOSS_COEFF = 0.01
CUDA_GRAPH_MODULES = ("attn", "moe_router", "moe_preprocess")

# Differentiable in eager and compiled alike (its backward is the reverse all-to-all); Dynamo traces it as
# _c10d_functional.all_to_all_single + wait_tensor. (Builds without torch.distributed only run group=None.)
if dist.is_available():
    from torch.distributed._functional_collectives import all_to_all_single_autograd as all_to_all


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _group_rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


@cgcompile.tag("moe_router")
class EPRouter(nn.Module):
    """Top-k softmax router. Returns (weights (T, k), expert ids (T, k), aux loss (scalar)).

    The aux loss is num_experts * sum_e f_e * P_e with P_e the mean router probability of expert e on this rank
    and f_e the fraction of all (token, k) slots of the EP group routed to e: the counts are summed with a
    fixed-shape `dist.all_reduce` (integer counts: no gradient flows through it, in eager and compiled alike).
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, group=None):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.group = group
        self.gate = nn.Linear(d_model, num_experts, bias=False)

    def forward(self, x: torch.Tensor):
        probs = F.softmax(self.gate(x), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)  # EP(all_reduce): fixed shape
        fraction = counts.to(probs.dtype) / counts.sum()
        aux = self.num_experts * (fraction * probs.mean(0)).sum()
        return weights, ids, aux


@cgcompile.tag("moe_preprocess")
class EPPreprocess(nn.Module):
    """Static-shape dispatch metadata: `order` (T*k,) sorts the (token, k) slots by expert id (so by destination
    rank), `counts` (E,) slots per expert sent by this rank, `recv_counts` (W*L,) slots this rank receives per
    (source rank, local expert), exchanged with a fixed-shape `dist.all_to_all_single` (E = W*L, equal splits)."""

    def __init__(self, num_experts: int, group=None):
        super().__init__()
        self.num_experts = num_experts
        self.group = group

    def forward(self, ids: torch.Tensor):
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        if self.group is None:
            return order, counts, counts
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # EP(counts_a2a): fixed shape
        return order, counts, recv_counts


@cgcompile.tag("moe")
class EPMoE(nn.Module):
    def __init__(self, d_model: int, num_local_experts: int = NUM_LOCAL_EXPERTS, top_k: int = TOP_K,
                 hidden: int | None = None, group=None, init_experts: bool = True):
        super().__init__()
        self.group = group
        self.world = _group_size(group)
        self.num_local_experts = num_local_experts
        self.num_experts = self.world * num_local_experts
        self.top_k = top_k
        self.router = EPRouter(d_model, self.num_experts, top_k, group)
        self.preprocess = EPPreprocess(self.num_experts, group)
        self.local_experts = nn.ModuleList(
            Expert(d_model, hidden or 2 * d_model) for _ in range(num_local_experts if init_experts else 0))

    def forward(self, x: torch.Tensor):
        b, s, d = x.shape
        world, local = self.world, self.num_local_experts
        h = x.reshape(b * s, d)
        weights, ids, aux = self.router(h)
        order, counts, recv_counts = self.preprocess(ids)
        slot_token = order // self.top_k  # the token of each sorted (token, k) slot
        input_splits = counts.view(world, local).sum(1).tolist()  # EP(sync): tolist
        recv = recv_counts.tolist()  # EP(sync): tolist
        output_splits = [sum(recv[r * local:(r + 1) * local]) for r in range(world)]
        tokens = h[slot_token]
        if self.group is not None:  # dispatch: each (token, k) slot goes to the rank owning its expert
            tokens = all_to_all(tokens, output_splits, input_splits, self.group)  # EP(a2a): dispatch
        # received chunks are ordered (source rank, local expert): regroup them by local expert
        chunks = torch.split(tokens, recv)  # EP(local): split
        per_expert = [torch.cat([chunks[r * local + e] for r in range(world)]) for e in range(local)]
        outs = [expert(t) for expert, t in zip(self.local_experts, per_expert)]
        back = [torch.split(y, [recv[r * local + e] for r in range(world)]) for e, y in enumerate(outs)]
        y = torch.cat([back[e][r] for r in range(world) for e in range(local)])
        if self.group is not None:
            y = all_to_all(y, input_splits, output_splits, self.group)  # EP(a2a): combine
        slot_weight = weights.reshape(-1)[order]
        out = torch.zeros_like(h).index_add_(0, slot_token, y * slot_weight.unsqueeze(-1))  # EP(combine): index_add
        return out.reshape(b, s, d), aux


class EPBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, num_local_experts: int, top_k: int, group=None,
                 init_experts: bool = True):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads)
        self.moe_norm = RMSNorm(d_model)
        self.moe = EPMoE(d_model, num_local_experts, top_k, group=group, init_experts=init_experts)

    def forward(self, x: torch.Tensor):
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux


class EPTransformer(nn.Module):
    """embed -> EPBlock x num_layers -> norm -> lm_head. forward(tokens) -> (logits, summed aux loss)."""

    def __init__(self, num_layers: int = 1, d_model: int = D_MODEL, n_heads: int = N_HEADS, vocab: int = VOCAB,
                 num_local_experts: int = NUM_LOCAL_EXPERTS, top_k: int = TOP_K, group=None,
                 init_experts: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(EPBlock(d_model, n_heads, num_local_experts, top_k, group, init_experts)
                                    for _ in range(num_layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor):
        x = self.embed(tokens)
        aux = x.new_zeros(())
        for layer in self.layers:
            x, layer_aux = layer(x)
            aux = aux + layer_aux
        return self.lm_head(self.norm(x)), aux


def build(num_layers: int = 1, seed: int = 0, *, group=None, d_model: int = D_MODEL, n_heads: int = N_HEADS,
          num_local_experts: int = NUM_LOCAL_EXPERTS, top_k: int = TOP_K) -> EPTransformer:
    """Deterministic EP model for this rank of `group` (None: one process holding every expert, no collectives).

    Shared weights depend only on the seed; the experts are initialised as the full set of
    world_size * num_local_experts experts and each rank keeps its own slice, so the EP group as a whole
    computes the same function as `build(group=None, num_local_experts=world_size * num_local_experts)`."""
    world, rank = _group_size(group), _group_rank(group)
    with seeded(seed):
        model = EPTransformer(num_layers, d_model, n_heads, VOCAB, num_local_experts, top_k, group,
                              init_experts=False)
    with seeded(seed + 1):
        for layer in model.layers:
            experts = [Expert(d_model, 2 * d_model) for _ in range(world * num_local_experts)]
            mine = experts[rank * num_local_experts:(rank + 1) * num_local_experts]
            layer.moe.local_experts = nn.ModuleList(mine)
    return model


def example_inputs(batch: int = 2, seq: int = 8, seed: int = 0, rank: int = 0, device=None) -> tuple:
    """Each rank feeds different tokens, so the split sizes differ between ranks (and between seeds)."""
    return token_inputs(batch, seq, seed * 1000 + rank, VOCAB, device)


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits, aux = model(tokens)
    return lm_loss(logits, tokens) + AUX_LOSS_COEFF * aux


# ---- source markers -------------------------------------------------------------------------------------

SOURCE_FILE = __file__
_MARKER = re.compile(r"#\s*EP\((?P<kind>\w+)\)")


def ep_lines(*kinds: str) -> list[int]:
    """Sorted 1-based line numbers in SOURCE_FILE of the lines marked `# EP(kind)` for the given kinds
    (sync, a2a, counts_a2a, all_reduce, local, combine); every marked line with no kinds given."""
    linecache.checkcache(SOURCE_FILE)
    found = []
    for lineno, text in enumerate(linecache.getlines(SOURCE_FILE), start=1):
        m = _MARKER.search(text)
        if m and (not kinds or m["kind"] in kinds):
            found.append(lineno)
    if kinds and not found:
        raise ValueError(f"no line marked with EP({'/'.join(kinds)}) in {SOURCE_FILE}")
    return found

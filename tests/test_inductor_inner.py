"""Inductor inside the captured partitions (inner_compiler="inductor"), exact against eager: the exactness suites'
cases (tests/hf training, the randomized parity test, DDP; decode is in tests/test_decode.py) once more with
Inductor compiling each partition (emulate driver, fp32 CPU).

Exact means within float32 rounding of eager: Inductor fuses and reorders (its C++ kernels accumulate in another
order), so the tolerances are those tests/hf and tests/test_random_models.py use where kernels may differ, not
bitwise. Every case also checks that the graphs captured at the capturing call are replayed by the later steps
and that no partition fell back to eager. Dropout and noise run with torch._inductor.config.fallback_random, so
Inductor draws with eager's generator and kernels.

Marked `inductor` (pyproject.toml): `-m "not inductor"` leaves them out locally; CI runs them. They compile
vectorized C++ kernels: about 2 minutes with an empty Inductor cache on two cores (a fresh CI clone), 30 s with a
warm one.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import cgcompile

try:
    from tests.graph_window import fresh
    from tests.inductor_cpp import needs_inductor_cpp
    from tests.spawn import run_ranks, serve
except ModuleNotFoundError:  # tests/ itself on sys.path
    from graph_window import fresh
    from inductor_cpp import needs_inductor_cpp
    from spawn import run_ranks, serve

pytestmark = [pytest.mark.inductor, needs_inductor_cpp]

INDUCTOR = {"cuda_graph_impl": "local", "driver": "emulate", "inner_compiler": "inductor", "cuda_graph_modules": [],
            "cuda_graph_warmup_steps": 1}  # step 1 warms up, step 2 captures, later steps replay
STEPS = 4
CAPTURE_STEP = 1
# float32 rounding of reordered kernels, as tests/hf (grads, RL logits) and tests/parity.py's callers allow
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = 1e-6  # largest weight difference after the optimizer steps (tests/hf's bound)
# Inductor's C++ kernels are vectorized here, as everywhere else in the suite. They compiled in about 2/3 of the
# time unvectorized (`cpp.vec_isa_ok=False`), but torch caches the CPU's vector ISAs per process on first use
# (torch._inductor.cpu_vec_isa.valid_vec_isa_list, functools.cache; checked 2.13): a process that compiled with
# vectorization before turning it off (a pytest-xdist worker running tests/test_decode.py's Inductor cases first)
# still generated vectorized kernels, and stored them in Inductor's FX graph cache under the unvectorized key; a
# later process loading them without the ISA's flags failed to compile them ("'at::vec' has not been declared").


def _replays():
    """Per captured partition: its replays so far, and why it fell back to eager for good (None: it did not)."""
    return {row["partition"]: (row["replays"], row["fallback"]) for row in cgcompile.stats()["partitions"]}


def train_against_eager(model, call, steps=STEPS, lr=0.1, options=INDUCTOR):
    """`steps` SGD steps through the compiled model and an eager copy made first, `call(module, step)` giving the
    loss. Per step: loss, every parameter's gradient and, after the optimizer step, every weight compared; returns
    the largest loss, gradient and weight differences, and the partitions' replays after each step (_replays)."""
    fresh()  # earlier tests' runtimes released: stats()["partitions"] (read by _replays) lists this run's only
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=lr) for m in (model, reference))
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    replays = []
    for step in range(steps):
        loss, ref = call(compiled, step), call(reference, step)
        torch.testing.assert_close(loss, ref, **LOSS_TOL, msg=f"loss at step {step}")
        worst["loss"] = max(worst["loss"], (loss - ref).abs().item())
        loss.backward()
        ref.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), f"{name} at step {step}"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, **GRAD_TOL, msg=f"{name} grad at step {step}")
                worst["grad"] = max(worst["grad"], (p.grad - q.grad).abs().max().item())
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
        worst["param"] = max(worst["param"], max((p - q).abs().max().item()
                                                 for p, q in zip(model.parameters(), reference.parameters())))
        replays.append(_replays())
    print(f"largest differences: {worst}")
    assert worst["param"] <= PARAM_TOL, worst
    return worst, replays


def assert_replayed_without_fallback(replays, captured_at_least=1):
    """Every partition the capturing step captured replayed in each later step (its count went up), nothing was
    captured after it, and no partition fell back to eager."""
    captured = replays[CAPTURE_STEP]
    assert len(captured) >= captured_at_least, captured
    assert cgcompile.stats()["eager_fallbacks"] == [], cgcompile.stats()["eager_fallbacks"]
    for before, after in zip(replays[CAPTURE_STEP:], replays[CAPTURE_STEP + 1:]):
        assert set(after) == set(captured), (captured, after)
        for name, (count, fallback) in after.items():
            assert fallback is None and count > before[name][0], (name, before[name], after[name])


# ---- Hugging Face (tests/hf/families.py: tiny configs built in code) --------------------------------------

@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_hf_training_matches_eager(family):
    """Llama (the capture-step gradient bug's repro) and Mixtral (fp32: the grouped-mm fallback's host reads are
    eager islands, everything else captured): loss, every gradient and the weights after each SGD step."""
    from tests.hf.families import build, tokens

    def call(m, step):
        ids = tokens(step)
        return m(input_ids=ids, labels=ids).loss

    from torch._dynamo.utils import counters

    before = dict(counters["inductor"])
    _, replays = train_against_eager(build(family, layers=3), call)
    assert_replayed_without_fallback(replays, captured_at_least=2)
    # Inductor's FX graph cache serves the second decoder layer's graphs (the same as the first's: each holds its
    # layer and the next layer's input norm, the cut sitting before the next matmul; the last layer's holds the
    # final norm): partitions are compiled with a ShapeEnv (_compat.aot_compile); without one every compile
    # bypassed the cache
    delta = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_bypass", "fxgraph_cache_hit")}
    assert delta["fxgraph_cache_bypass"] == 0 and delta["fxgraph_cache_hit"] >= 2, delta


# ---- torch.nn attention (MultiheadAttention got wrong gradients from the capturing step before the fix) ---

class Encoder(torch.nn.Module):
    def __init__(self, d=32, heads=4, layers=1, vocab=64, dropout=0.1):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, dropout=dropout, batch_first=True)
            for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def build_encoder():
    torch.manual_seed(0)
    return Encoder().train()


def encoder_loss(model, ids):
    """The loss of one call, its dropout drawn from a seed of its tokens (the compiled model and its eager twin draw
    the same masks)."""
    torch.manual_seed(int(ids.sum()))
    return model(ids)


def encoder_tokens(seed):
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


def test_transformer_encoder_training_with_dropout_matches_eager():
    """nn.TransformerEncoderLayer (nn.MultiheadAttention inside), dropout on: fallback_random draws as eager."""
    with torch._inductor.config.patch(fallback_random=True):
        _, replays = train_against_eager(build_encoder(), lambda m, step: encoder_loss(m, encoder_tokens(step)))
    assert_replayed_without_fallback(replays)


# ---- the randomized parity test's models (tests/test_random_models.py), fixed layouts ----------------------

# (pattern, tag, eager_region) per block, every pattern at least once; cuda_graph_modules selects some tags
LAYOUTS = {
    "grad-modes": ([("no_grad_stats", "attn", False), ("enable_grad_in_no_grad", "mlp", False), ("noise", "attn", False),
                    ("inplace", "custom", False), ("autocast", "mlp", False), ("plain", None, True)],
                   ["attn", "mlp", "custom"], 11, True),
    "host-reads": ([("no_grad_host_read", "attn", False), ("scan", "mlp", False), ("repeat", "custom", False),
                    ("view_then_no_grad_host_read", "attn", False)], ["attn", "mlp"], 12, False),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_random_model_layouts_train_like_eager(name):
    from tests.test_random_models import build, run_pair

    layout, modules, seed, no_grad_call = LAYOUTS[name]
    fresh()  # stats()["partitions"] below: this run's partitions only
    model, reference = build(layout)
    options = dict(INDUCTOR, cuda_graph_modules=modules)
    with torch._inductor.config.patch(fallback_random=True), \
            torch._dynamo.config.patch(capture_scalar_outputs=True):
        run_pair(model, reference, options, steps=STEPS, seed=seed, no_grad_call=no_grad_call)
    stats = cgcompile.stats()
    assert stats["eager_fallbacks"] == [], stats["eager_fallbacks"]
    assert stats["graphs_captured"] > 0 and stats["steady_replays"] > 0, stats
    for row in stats["partitions"]:  # the training partitions replay; the one no_grad call's only captured
        assert row["fallback"] is None and (row["replays"] > 0 or row["calls"] == 1), row


# ---- DDP on two gloo ranks (tests/test_ddp.py's loop, Inductor inside) -------------------------------------

WORLD = 2
TIMEOUT_S = 240


def work(rank: int, world: int) -> dict:
    """The encoder above under DDP (small enough for one bucket, so Dynamo does not split it), eager DDP next to
    it; one Inductor compile thread per rank (two ranks on two cores)."""
    from tests.test_ddp import OPTIONS, _train

    with torch._inductor.config.patch(dict(fallback_random=True, compile_threads=1)):
        return _train(rank, STEPS, 1, False, build=build_encoder, loss_fn=encoder_loss, inputs=encoder_tokens,
                      options=dict(OPTIONS, cuda_graph_modules=[], inner_compiler="inductor"))


@pytest.mark.distributed
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo")
def test_ddp_training_matches_eager_ddp(tmp_path):
    for rank, result in enumerate(run_ranks(__file__, tmp_path, WORLD, TIMEOUT_S, "DDP inductor")):
        steps = result["steps"]
        print(f"rank {rank}: largest differences {[{k: s[k] for k in ('loss_diff', 'grad_diff', 'param_diff')} for s in steps]}")
        for step in steps:
            assert step["loss_diff"] <= 1e-5 and step["grad_diff"] <= 1e-5 and step["param_diff"] <= PARAM_TOL, steps
        assert result["ranks_agree"] == 0.0, "DDP keeps the replicas equal"
        warm, end = result["warm"], result["end"]
        assert warm["graphs_captured"] > 0 and not end["eager_fallbacks"], (warm, end)
        assert end["graphs_captured"] == warm["graphs_captured"] and end["recaptures"] == 0, (warm, end)
        assert end["replays"] > warm["replays"], (warm, end)


if __name__ == "__main__":
    serve(work, TIMEOUT_S)


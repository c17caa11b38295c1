"""KV-cache decode (tests/models/kv_gpt.py): the step plans as one captured graph in block scope, its cache
writes go to buffers, and greedy decode matches eager token for token (emulate driver; CUDA in tests/gpu)."""

import copy
import logging

import pytest
import torch

import cgcompile
from cgcompile import _compat
from cgcompile.backend import record_plans
from tests.frame_ops import FrameOps, counting_backend, replays_flagged
from tests.inductor_cpp import needs_inductor_cpp
from tests.models import kv_gpt

OPTIONS = {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": "block"}
STEPS = 16


def decode_twins(device="cpu", **build):
    model = kv_gpt.build(**build).to(device).eval()
    return model, copy.deepcopy(model)


def assert_decode_matches_eager(options, device="cpu", steps=STEPS, batch=4, exact=True):
    model, reference = decode_twins(device)
    (prompt,) = kv_gpt.example_inputs(batch=batch, seq=8, device=device)
    compiled = torch.compile(kv_gpt.DecodeStep(model), backend="cudagraph_modules", options=options)
    cgcompile.reset_stats()
    with record_plans() as rec:
        got = kv_gpt.generate(compiled, model, prompt, steps)
    want = kv_gpt.generate(kv_gpt.DecodeStep(reference), reference, prompt, steps)
    assert torch.equal(got, want)
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-4, atol=1e-5)
    for (name, cache), ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(cache, ref, msg=name, **tol)  # every cache write landed, once
    return rec.graphs, cgcompile.stats()


def test_decode_step_plans_as_one_captured_graph():
    model, _ = decode_twins()
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    with torch.no_grad():
        token = kv_gpt.prefill(model, prompt)
        plan = cgcompile.explain(kv_gpt.DecodeStep(model), token, torch.tensor([8]),
                                 options=dict(OPTIONS, driver="emulate"))
    (graph,) = plan.graphs
    assert [p.kind for p in graph.partitions] == ["capture"]  # index_copy_ into cache buffers is capture-safe
    assert graph.partitions[0].tags == ("attn", "mlp")


INNER_COMPILERS = ["eager", "auto", pytest.param("inductor", marks=[needs_inductor_cpp, pytest.mark.inductor])]


@pytest.fixture
def inductor_requests(monkeypatch):
    """Whether each partition's aot compile asked for Inductor (a spy: _compat.aot_compile still runs)."""
    asked = []
    real = _compat.aot_compile

    def spy(*args, inductor=False, **kwargs):
        asked.append(inductor)
        return real(*args, inductor=inductor, **kwargs)

    monkeypatch.setattr(_compat, "aot_compile", spy)
    return asked


@pytest.mark.parametrize("inner", INNER_COMPILERS)
def test_decode_matches_eager_over_16_steps(inner, inductor_requests, caplog):
    with caplog.at_level(logging.INFO, logger="cgcompile"):
        graphs, st = assert_decode_matches_eager(dict(OPTIONS, driver="emulate", inner_compiler=inner),
                                                 exact=inner != "inductor")
    assert set(inductor_requests) == {inner == "inductor"}  # auto: Inductor only where the cuda driver captures
    resolved = "inductor" if inner == "inductor" else "eager"
    assert any(f"(driver emulate, inner compiler {resolved})" in r.getMessage() for r in caplog.records)
    (graph,) = graphs
    assert len(graph.captured) == 1 and len(graph.partitions) == 1
    warmup = 3
    assert st["graphs_captured"] == 1 and st["eager_fallbacks"] == []
    assert st["steady_replays"] == STEPS - warmup - 1  # every call after the capture call replays


def test_full_iteration_decodes_like_eager():
    _, st = assert_decode_matches_eager({"cuda_graph_impl": "full_iteration", "driver": "emulate"})
    assert st["graphs_captured"] == 1 and st["eager_fallbacks"] == []


def steady_step_ops(options, **build):
    """The ops one steady decode step dispatches outside replayed graphs (`.ops`) and inside them (`.graph_ops`),
    after warmup, capture and replays; with the model."""
    torch._dynamo.reset()
    model, _ = decode_twins(**build)
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    counters = []
    step = torch.compile(kv_gpt.DecodeStep(model), backend=counting_backend(options, counters))
    pos = kv_gpt.positions(model.max_seq)
    with torch.no_grad(), replays_flagged():
        token = kv_gpt.prefill(model, prompt)
        for i in range(5):  # warmup, capture, replays
            token = step(token, pos[8 + i])
        counters.append(FrameOps())
        step(token, pos[13])
    return counters.pop(), model


@pytest.mark.parametrize("inner", INNER_COMPILERS)
def test_steady_decode_step_runs_nothing_outside_the_graph_but_input_copies(inner):
    """Per call, outside the replayed graph: one copy of the non-static inputs (token, input_pos), one detach for
    the output handed out and its clone leaving the frame. The cache writes happen inside the graph (aot's
    inference epilogue would copy every written cache buffer eagerly after it), for both inner compilers."""
    counted, model = steady_step_ops(dict(OPTIONS, driver="emulate", inner_compiler=inner))
    # outside the graph: the step's token and position copied in, the output copied straight out of graph memory
    # as it leaves the frame (PartitionRunner.leaving: no alias detached only to be cloned)
    assert counted.ops == {"aten._foreach_copy_.default": 1, "aten.clone.default": 1}, inner
    if inner == "eager":  # the graph's own ops (Inductor's are C++ kernels): each cache written in place, as eager
        # does (rewrites/input_writes.py), not rebuilt whole (slice_scatter) and copied back (copy_)
        # (the one copy_ is the emulator's own: the step's output into its static buffer, no work on a GPU)
        writes = {op: n for op, n in counted.graph_ops.items() if "copy" in op or "scatter" in op}
        assert writes == {"aten.index_copy_.default": 2 * len(model.layers), "aten.copy_.default": 1}, writes


def test_layer_scope_copies_what_every_layer_reads_in_once_per_step():
    """Layer scope: each layer's graph reads the step's position and attention mask, made outside every graph.
    The first layer's graph copies them in and returns clones of them made inside it, which the later layers read
    where they lie (rewrites/shared_inputs.py): one copy launch per step, not one per layer. Decodes like eager,
    every layer replayed steadily."""
    options = dict(OPTIONS, inference_cuda_graph_scope="layer", driver="emulate")
    counted, model = steady_step_ops(options, num_layers=3)
    assert counted.ops.get("aten._foreach_copy_.default") == 1, counted.ops  # was one per layer
    # inside the first layer's graph: its clones of the position and the mask (emulator's copies aside)
    assert counted.graph_ops.get("aten.clone.default") == 2, counted.graph_ops
    graphs, st = assert_decode_matches_eager(options)
    assert st["eager_fallbacks"] == [] and st["steady_replays"] >= (STEPS - 5) * len(graphs[0].captured)


MAX_POSITIONS = 16


@cgcompile.tag("attn")
class CacheArgAttention(torch.nn.Module):
    """Attention whose KV cache the caller allocates and passes in (gpt-fast's style), written at `positions`."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x, keys, values, positions, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        keys.index_copy_(2, positions, k.transpose(1, 2))
        values.index_copy_(2, positions, v.transpose(1, 2))
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class CacheArgModel(torch.nn.Module):
    def __init__(self, layers: int = 2, vocab: int = 32, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.layers = torch.nn.ModuleList([CacheArgAttention(width) for _ in range(layers)])

    def forward(self, tokens, caches, positions):
        mask = (torch.arange(MAX_POSITIONS) <= positions[:, None])[None, None]
        x = self.embed(tokens)
        for layer, (keys, values) in zip(self.layers, caches):
            x = x + layer(x, keys, values, positions, mask)
        return self.head(x)[:, -1].argmax(-1, keepdim=True)


@pytest.mark.parametrize("static", [False, True])
def test_a_cache_passed_in_is_captured_once_marked_static(static):
    """A cache passed as an argument and written in place is an input a graph would write into its own copy of:
    its writes stay eager (input_mutation) and the hint names the fix, torch._dynamo.mark_static_address, which
    then captures the layers and replays them on every later step, reading and writing the caller's cache in place.
    Token for token and cache for cache equal to eager."""
    model = CacheArgModel().eval()
    reference = copy.deepcopy(model)

    def caches():
        made = [(torch.zeros(2, 2, MAX_POSITIONS, 8), torch.zeros(2, 2, MAX_POSITIONS, 8)) for _ in range(2)]
        for cache in (t for pair in made for t in pair):
            if static:
                torch._dynamo.mark_static_address(cache)
        return made

    options = {"driver": "emulate", "cuda_graph_modules": ["attn"], "cuda_graph_warmup_steps": 1}
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    cgcompile.reset_stats()
    ours, theirs = caches(), caches()
    token = want = torch.tensor([[1], [2]])
    with torch.no_grad(), record_plans() as rec:
        for position in range(12):
            at = torch.tensor([position])
            token, want = compiled(token, ours, at), reference(want, theirs, at)
            assert torch.equal(token, want), position
            assert all(torch.equal(a, b) for pair, ref in zip(ours, theirs) for a, b in zip(pair, ref))
    layers = [p for plan in rec.graphs for p in plan.partitions if p.tags == ("attn",)]
    stats = cgcompile.stats()
    if not static:
        assert stats["graphs_captured"] == 0
        hints = {r.hint for p in layers for r in p.reasons if r.category == "input_mutation"}
        assert hints and all("mark_static_address" in hint for hint in hints), hints
        return
    assert [p.kind for p in layers] == ["capture", "capture"]
    before = stats["steady_replays"]
    with torch.no_grad():
        compiled(token, ours, torch.tensor([12]))
    assert cgcompile.stats()["steady_replays"] - before == 2 and cgcompile.stats()["eager_fallbacks"] == []

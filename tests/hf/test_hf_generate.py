"""`model.generate(cache_implementation="static")` compiled through transformers' own CompileConfig with our
backend: the greedy tokens equal eager's, and the decode steps replay captured graphs."""

import re

import torch

import cgcompile
from tests.hf.families import build, tokens, transformers


def test_generate_with_compile_config_gives_the_eager_tokens():
    model = build("llama").eval()
    ids = tokens(0, batch=2, seq=6)
    mask = torch.ones_like(ids)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          cache_implementation="static")
    # mode=None: CompileConfig's default mode ("reduce-overhead") cannot go with backend options.
    config = transformers.CompileConfig(backend="cudagraph_modules", mode=None, fullgraph=False,
                                        options={"driver": "emulate", "cuda_graph_warmup_steps": 1})
    config._compile_all_devices = True  # transformers compiles the decode step only on GPUs unless told
    cgcompile.reset_stats()
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         cache_implementation="static", compile_config=config)
    assert got.tolist() == want.tolist() and got.shape[1] == ids.shape[1] + 8
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [] and st["graphs_captured"] >= 1 and st["steady_replays"] >= 5, st


def test_generate_with_the_default_cache_stops_capturing_and_names_the_growing_cache():
    """transformers' default DynamicCache concatenates each step's keys and values: every decode step is a new
    size that never comes back. The tokens stay eager's; each partition reading the cache stops capturing new
    sizes, and its message names the cache's sequence dimension and the static-cache fix."""
    model = build("llama").eval()
    ids = tokens(0, batch=2, seq=6)
    mask = torch.ones_like(ids)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    torch._dynamo.reset()
    cgcompile.reset_stats()
    model.forward = torch.compile(model.forward, backend="cudagraph_modules", options={"driver": "emulate"})
    got = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert got.tolist() == want.tolist()
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [] and st["bank_stops"], st
    for stop in st["bank_stops"]:
        assert re.search(r"dim 2 grew by 1 at each new size \(7, 8, 9, .*\).*cache_implementation=\"static\"",
                         stop["reason"]), stop
    assert any("past_key_values.layers.0.keys" in stop["reason"] for stop in st["bank_stops"]), st["bank_stops"]
    # a size runs uncompiled at its first call and compiles only if it comes again: none of these sizes did
    stopped = [row for row in st["partitions"] if row["stopped"]]
    assert len(stopped) == len(st["bank_stops"]) and all(row["compiled_sizes"] == 0 for row in stopped), stopped

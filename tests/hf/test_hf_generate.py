"""`model.generate(cache_implementation="static")` compiled through transformers' own CompileConfig with our
backend: the greedy tokens equal eager's, and the decode steps replay captured graphs."""

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

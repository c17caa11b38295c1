"""The KV-cache decode loop the steady-replay tests run (tests/models/kv_gpt.py): a compiled decode step beside an
eager copy of the model, and the check that both generate the same tokens and leave the same caches."""

from __future__ import annotations

import copy

import torch

from tests.models import kv_gpt


def decode(scope: str, layers: int = 2, inner: str = "eager"):
    """A model, its eager copy, and its decode step compiled for inference scope `scope` (emulate driver)."""
    model = kv_gpt.build(num_layers=layers).eval()
    reference = copy.deepcopy(model)
    options = {"cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": scope, "driver": "emulate",
               "inner_compiler": inner}
    step = torch.compile(kv_gpt.DecodeStep(model), backend="cudagraph_modules", options=options)
    return model, reference, step


def run(step, model, reference, prompt, steps) -> None:
    """`steps` decode steps from the prompt through `step` and through eager: the same tokens and caches."""
    with torch.no_grad():
        got = kv_gpt.generate(step, model, prompt, steps)
        want = kv_gpt.generate(kv_gpt.DecodeStep(reference), reference, prompt, steps)
    assert torch.equal(got, want)
    for (name, cache), ref in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(cache, ref), name

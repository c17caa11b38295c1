"""The dynamic_padding training run shared by tests/test_dynamic_padding.py (emulate) and
tests/gpu/test_gpu_dynamic_padding.py (CUDA); apart from them so the GPU twin imports no optional test package."""

import torch

STEPS = 6


def padding_options(mode, **extra):
    return {"cuda_graph_impl": "local", "driver": "emulate", "dynamic_padding": mode, "cuda_graph_warmup_steps": 1,
            "inner_compiler": "eager", **extra}  # auto's choice off CUDA: the GPU twins run it too


def train_like_eager(spec, model, compiled, reference, steps=STEPS, accumulate=1, device=None, scale=1.0):
    """New tokens every step; SGD-with-momentum steps on both (linear in the gradients, so float32 rounding in
    the padded sums stays rounding; Adam would blow a 1e-10 gradient difference up to a full step); losses,
    every gradient and the parameters must match (tolerances times `scale`: CUDA's index_add sums in any
    order)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        for micro in range(accumulate):
            (tokens,) = spec.example_inputs(seed=100 * step + micro, device=device)
            loss, ref = spec.loss(compiled, tokens), spec.loss(reference, tokens)
            torch.testing.assert_close(loss, ref, rtol=1e-6 * scale, atol=1e-6 * scale)
            loss.backward()
            ref.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5 * scale, atol=1e-6 * scale, msg=name)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5 * scale, atol=1e-6 * scale)

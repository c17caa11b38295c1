"""The parity check the compiled-path tests share: one training step through the compiled model and eager."""

import torch


def assert_step_matches_eager(spec, compiled, model, reference, tokens) -> None:
    """Forward and backward through both; the loss must be equal and every gradient equal up to float32
    rounding (backward kernels may accumulate in another order)."""
    loss, ref = spec.loss(compiled, tokens), spec.loss(reference, tokens)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)

"""runtime/local/frame_outputs.py: a frame's outputs copied out of graph memory, several of one dtype in one
`_foreach_copy_` (one CUDA kernel), with what `clone` gives: values, layouts, autograd history."""

from __future__ import annotations

import copy

import torch

import cgcompile
from cgcompile._compat import TorchDispatchMode
from cgcompile.runtime.local.frame_outputs import copy_out
from cgcompile.runtime.local.zero_grads import is_made_zeros, layout_of, zeros_for


class Copies(TorchDispatchMode):
    """The copies and clones a call dispatches, each with its (destination, source) dtypes: what CUDA would be
    asked to run (a dispatch mode sees the dtypes on every torch; the profiler records them from 2.12 on)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._foreach_copy_.default:
            self.calls.append(("foreach", [(d.dtype, s.dtype) for d, s in zip(args[0], args[1])]))
        elif func in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default):
            self.calls.append((func.__name__.split(".")[0], [(args[0].dtype, args[-1].dtype)]))
        return func(*args, **(kwargs or {}))


def test_copies_equal_clones_in_values_layouts_and_gradients():
    base = torch.randn(4, 6, requires_grad=True)
    tensors = [base * 2, (base * 3).t(), base.detach().to(torch.bfloat16), base.sum(), torch.arange(3),
               (base * 4).to(torch.bfloat16)]
    with Copies() as copies_made:
        copies = copy_out(tensors)
    # one copy of the bits of the five dense ones (float32, bfloat16, the scalar, int64) as int16, which CUDA's
    # multi-tensor route takes in one kernel (one dtype on each side, equal sizes and strides); the transposed
    # float32 one, whose last dimension is not contiguous, alone; nothing cloned
    assert sorted(copies_made.calls) == [("copy_", [(torch.float32, torch.float32)]),
                                         ("foreach", [(torch.int16, torch.int16)] * 5)], copies_made.calls
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.stride() == t.stride() and c.data_ptr() != t.data_ptr()
        assert c.requires_grad == t.requires_grad
    weights = [torch.randn_like(c, dtype=torch.float32) for c in copies if c.requires_grad]
    grads = torch.autograd.grad([(c.float() * w).sum() for c, w in zip([c for c in copies if c.requires_grad],
                                                                        weights)], base, retain_graph=True)
    want = torch.autograd.grad([(t.float() * w).sum() for t, w in zip([t for t in tensors if t.requires_grad],
                                                                       weights)], base)
    torch.testing.assert_close(grads, want, rtol=0, atol=0)


def test_a_copy_of_mixed_dtypes_moves_bits_exactly():
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])  # a NaN, a negative zero, a subnormal
    tensors = [special, special.to(torch.bfloat16), torch.tensor(True), torch.tensor([-1, 2**40]),
               torch.tensor(-7, dtype=torch.int8)]
    copies = copy_out(tensors)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.data_ptr() != t.data_ptr()
        assert torch.equal(c.view(1).view(torch.uint8) if c.dim() == 0 else c.view(torch.uint8),
                           t.view(1).view(torch.uint8) if t.dim() == 0 else t.view(torch.uint8))


def test_a_large_tensor_is_never_copied_as_narrower_integers():
    """fp32 logits beside bf16 key/value tensors and the fp32 loss: the logits copy as fp32 (a narrower copy moves
    fewer bytes per load), the bf16 ones and the small loss together as int16."""
    tensors = [torch.randn(64, 64), torch.randn(64, 64).to(torch.bfloat16), torch.randn(64, 64).to(torch.bfloat16),
               torch.randn(()).abs()]
    with Copies() as copies_made:
        copies = copy_out(tensors)
    assert sorted(copies_made.calls) == [("copy_", [(torch.float32, torch.float32)]),
                                         ("foreach", [(torch.int16, torch.int16)] * 3)], copies_made.calls
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies))


def test_lone_tensors_of_their_dtype_are_cloned():
    tensors = [torch.randn(3), torch.arange(4)[::2]]  # the int64 one has gaps: no view of its bits joins a copy
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        copies = copy_out(tensors)
    names = [e.name for e in prof.events()]
    assert names.count("aten::clone") == 2 and "aten::_foreach_copy_" not in names
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies))


class ThreeOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        k = self.b(h)
        return h.sum() + k.pow(2).mean(), k, h


def three_outputs_compiled():
    """(model, its eager twin, the model compiled with the emulate driver and one warmup step); stats reset."""
    torch.manual_seed(0)
    model = ThreeOutputs()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "cuda_graph_warmup_steps": 1})
    cgcompile.reset_stats()
    return model, reference, compiled


def test_a_training_frames_outputs_leave_in_one_copy_and_train_like_eager():
    model, reference, compiled = three_outputs_compiled()
    kept = []
    for step in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        if step == 4:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = compiled(x)
        else:
            out = compiled(x)
        want = reference(x)
        (out[0] + out[1].sum() * 0.5).backward()
        (want[0] + want[1].sum() * 0.5).backward()
        for got, expected in zip(out, want):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            p.grad = q.grad = None
        kept.append(out)
    assert cgcompile.stats()["steady_replays"] > 0
    # outputs kept from every step still hold their own step's values (none was overwritten by a later replay)
    for step, out in enumerate(kept):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        torch.testing.assert_close(out[1], reference(x)[1], rtol=0, atol=0)
    copies = [e for e in prof.events() if e.name == "aten::_foreach_copy_"
              and sum(c.name == "aten::copy_" for c in e.cpu_children) == 3]
    assert copies and not [e for e in prof.events() if e.name == "aten::clone"]  # the three outputs, in one copy


def test_zeros_for_an_output_are_autograds_zeros_marked_until_written():
    source = torch.randn(3, 4).t()  # contiguous zeros whatever the output's strides, as autograd makes them
    z = zeros_for(layout_of(source))
    assert torch.equal(z, torch.zeros(4, 3)) and z.is_contiguous() and is_made_zeros(z)
    assert zeros_for(layout_of(source)) is not z and not is_made_zeros(torch.zeros(4, 3))
    z.add_(1)  # written: no longer known to be zeros
    assert not is_made_zeros(z)


def steps_like_eager(compiled, model, reference, uses, backward_twice=()):
    """Train `compiled` and `reference` side by side; `uses[step]`: does the loss use the second output?"""
    for step, use in enumerate(uses):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        losses = []
        for fn in (compiled, reference):
            out = fn(x)
            loss = out[0] + (out[1].sum() * 0.5 if use else 0)
            if step in backward_twice:
                loss.backward(retain_graph=True)
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            p.grad = q.grad = None


def test_outputs_without_a_gradient_get_zeros_the_backward_graph_copies_in_once():
    """The backward of a frame whose loss leaves two outputs without a gradient: their zeros are made (as autograd
    would) but not copied into the backward graph's buffers once those hold zeros; exact against eager, also
    when a step does use an output (a real gradient is copied in), a second backward (run eagerly) and back."""
    model, reference, compiled = three_outputs_compiled()
    steps_like_eager(compiled, model, reference, [False] * 4)
    x = torch.randn(4, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        compiled(x)[0].backward()
    steady = cgcompile.stats()["steady_replays"]
    assert steady > 0
    assert [e.name for e in prof.events()].count("aten::zeros") == 2  # for k and h, as autograd would
    copied = [[c.input_shapes[0] for c in e.cpu_children if c.name == "aten::copy_"]
              for e in prof.events() if e.name == "aten::_foreach_copy_"]
    # x into the forward's buffer, the three outputs out, and into the backward's buffers only the loss's
    # gradient (shape []): zeros for k and h are there from the step before (it was [[], [4, 8], [4, 8]])
    assert copied == [[[4, 8]], [[], [4, 8], [4, 8]], [[]]], copied
    for p in model.parameters():
        p.grad = None
    steps_like_eager(compiled, model, reference, [True, False, False, True, False], backward_twice={2})
    assert cgcompile.stats()["steady_replays"] > steady

"""Driver semantics on CPU: emulate keeps one set of static buffers and output objects, like a CUDA graph."""

import pytest
import torch

from cgcompile.runtime.drivers.base import CaptureError, is_capturing
from cgcompile.runtime.drivers.select import EagerDriver, get_driver
from cgcompile.runtime.drivers.emulate import EmulateDriver


def _fn(args):
    x, w = args
    return [torch.relu(x @ w), x.sum()]


def test_emulate_replays_into_the_same_output_objects():
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    graph = EmulateDriver().capture(_fn, [x, w])
    first = graph.replay()
    second = graph.replay()
    assert first[0] is second[0] and first[1] is second[1]
    assert first[0] is graph.static_outputs[0]
    assert torch.equal(first[0], torch.relu(x @ w))


def test_emulate_reads_the_static_input_buffers():
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    graph = EmulateDriver().capture(_fn, [x, w])
    x.copy_(torch.ones(3, 4))  # what the runtime does: copy new data into the captured buffer
    out = graph.replay()
    assert torch.equal(out[0], torch.relu(torch.ones(3, 4) @ w))
    assert out[1].item() == 12.0


def test_emulate_outputs_are_garbage_until_first_replay():
    """A real capture runs no kernels; reading outputs before replay must not look correct."""
    graph = EmulateDriver().capture(_fn, [torch.randn(3, 4), torch.randn(4, 2)])
    assert torch.isnan(graph.static_outputs[0]).all()


def test_emulate_output_aliasing_an_input_is_left_in_place():
    x = torch.randn(4)
    graph = EmulateDriver().capture(lambda args: [args[0].view(2, 2), args[0] * 2], [x])
    version = x._version
    out = graph.replay()
    assert out[0].data_ptr() == x.data_ptr() and x._version == version  # no copy_ into the input
    assert torch.equal(out[1], x * 2)


def test_emulate_rejects_host_syncs_during_capture():
    for fn in (lambda a: [a[0] * a[0].sum().item()],
               lambda a: [torch.nonzero(a[0])],
               lambda a: [a[0][a[0] > 0]],
               lambda a: [a[0].index_put((a[0] > 0,), torch.tensor(0.0))]):
        with pytest.raises(CaptureError, match="not permitted when stream is capturing"):
            EmulateDriver().capture(fn, [torch.randn(4)])


def test_emulate_allows_integer_indexing_and_static_repeat_interleave():
    idx = torch.tensor([0, 2])
    fn = lambda a: [a[0][a[1]], torch.repeat_interleave(a[0], a[1] + 1, output_size=3)]  # noqa: E731
    graph = EmulateDriver().capture(fn, [torch.randn(2), idx[:2].clamp(max=1)])
    assert len(graph.replay()) == 2


def test_is_capturing_only_during_capture():
    seen = []

    def fn(args):
        seen.append(is_capturing())
        return [args[0] + 1]

    graph = EmulateDriver().capture(fn, [torch.zeros(2)])
    graph.replay()
    assert seen == [True, False] and not is_capturing()


def test_emulate_draws_fresh_random_numbers_per_replay():
    graph = EmulateDriver().capture(lambda a: [torch.rand_like(a[0])], [torch.zeros(1000)])
    first = graph.replay()[0].clone()
    second = graph.replay()[0]
    assert not torch.equal(first, second)


def test_emulate_runs_without_autograd():
    w = torch.randn(4, requires_grad=True)
    graph = EmulateDriver().capture(lambda a: [a[0] * 2], [w])
    out = graph.replay()[0]
    assert not out.requires_grad and out.grad_fn is None


def test_eager_driver_captures_nothing():
    assert not EagerDriver().captures  # the runtime runs such partitions as they are, never calling capture()


def test_get_driver():
    assert get_driver("auto", "cpu").name == "eager"
    assert get_driver("emulate", "cpu").name == "emulate"
    assert get_driver("eager", torch.device("cpu")).name == "eager"
    with pytest.raises(ValueError, match="emulate"):
        get_driver("cuda", "cpu")
    with pytest.raises(ValueError, match="unknown driver"):
        get_driver("bogus", "cpu")


def test_a_failed_capture_leaves_no_state_and_the_same_pool_token_captures_next():
    """What a CUDA capture failure must not do: leave a pool recording, a mode or flag on, or
    half-applied writes. Emulate marks the failed pool as torch does; the driver retires it for the token."""
    driver = EmulateDriver()
    pool = driver.new_pool()
    x = torch.zeros(3)

    def failing(args):
        args[0].add_(1)  # a write the failed capture must undo
        return [args[0] * args[0].sum().item()]

    with pytest.raises(CaptureError, match="not permitted"):
        driver.capture(failing, [x], pool)
    assert not is_capturing() and torch._C._len_torch_dispatch_stack() == 0
    assert torch.equal(x, torch.zeros(3))
    assert driver.live_pool(pool) is not pool  # the token now stands for a fresh pool
    graph = driver.capture(lambda a: [a[0] + 1], [x], pool)  # same token
    other = driver.capture(lambda a: [a[0] + 2], [x], driver.new_pool())  # another pool
    assert torch.equal(graph.replay()[0], torch.ones(3)) and torch.equal(other.replay()[0], torch.full((3,), 2.0))


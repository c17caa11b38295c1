"""The CUDA path's device, pool and RNG rules with real CUDA graphs; skipped without a CUDA device. The CPU twin,
tests/test_cuda_path.py, checks the decisions; here what only a GPU shows: captures on the model's device, pools
re-used after their graphs were reset, the default generator after a failed capture."""

import copy

import pytest
import torch
import torch.nn.functional as F

import cgcompile
from tests.test_runtime_traps import Net, batch, compiled
from tests.test_runtime_traps import runtimes  # noqa: F401  (a pytest fixture, used by name)

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _device_pairs():
    """(model device, current device): a mismatch needs two devices; one GPU runs the matched pair only."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [(1, 0), (0, 1)] if n > 1 else [(0, 0)]


@pytest.mark.parametrize("model_index, current_index", _device_pairs())
def test_a_model_on_another_device_than_the_current_one_is_captured_there(model_index, current_index,
                                                                          runtimes):  # noqa: F811
    """A model on cuda:1 while the current device is 0 (torchrun without set_device): streams, pools and
    captures must be on cuda:1, or the capture records nothing and replays return stale outputs."""
    device = torch.device("cuda", model_index)
    torch.manual_seed(0)
    model = Net().to(device)
    reference = copy.deepcopy(model)
    cgcompile.reset_stats()
    with torch.cuda.device(current_index):
        run = compiled(model, driver="cuda")
        for step in range(6):
            x, y = (t.to(device) for t in batch(step))
            model.zero_grad(), reference.zero_grad()
            loss, expected = F.mse_loss(run(x), y), F.mse_loss(reference(x), y)
            loss.backward(), expected.backward()
            torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        assert torch.cuda.current_device() == current_index
    st = cgcompile.stats()
    assert st["graphs_captured"] > 0 and st["steady_replays"] > 0 and st["eager_fallbacks"] == [], st
    assert runtimes and {rt.device for rt in runtimes} == {device}


def test_eager_draws_work_after_a_capture_failed_inside_cuda():
    """A sync inside the capture (warmup=False skips the guard) invalidates it; on torch 2.11 the default
    generator then stayed in capture mode and the next eager draw raised "Offset increment outside graph
    capture encountered unexpectedly". Afterwards draws work, and the undo drew nothing."""
    from cgcompile.runtime.drivers.cuda import CudaDriver
    from cgcompile.runtime.drivers.base import CaptureError

    driver = CudaDriver(torch.device("cuda"))
    x = torch.randn(4, device="cuda")
    state = torch.cuda.get_rng_state()
    with pytest.raises(CaptureError):
        driver.capture(lambda a: [a[0] * a[0].sum().item()], [x], driver.new_pool(), warmup=False)
    first = torch.rand(8, device="cuda")
    dropped = F.dropout(torch.ones(64, device="cuda"), 0.5)
    torch.cuda.set_rng_state(state)
    torch.testing.assert_close(first, torch.rand(8, device="cuda"))
    torch.testing.assert_close(dropped, F.dropout(torch.ones(64, device="cuda"), 0.5))
    graph = driver.capture(lambda a: [F.dropout(a[0], 0.5)], [torch.ones(1024, device="cuda")])
    masks = [graph.replay()[0].clone() for _ in range(2)]
    assert not torch.equal(masks[0], masks[1])  # captures draw fresh numbers per replay again


def test_a_capture_drawing_from_an_own_generator_fails_with_the_fix_and_leaves_both_generators_usable():
    from cgcompile.runtime.drivers.cuda import CudaDriver
    from cgcompile.runtime.drivers.base import CaptureError

    own = torch.Generator(device="cuda").manual_seed(1)
    driver = CudaDriver(torch.device("cuda"))
    x = torch.zeros(4, device="cuda")
    with pytest.raises(CaptureError, match="torch.Generator of its own"):
        driver.capture(lambda a: [a[0] + torch.rand(4, device="cuda", generator=own)], [x])
    torch.rand(4, device="cuda", generator=own)
    torch.rand(4, device="cuda")


def test_a_token_whose_graphs_were_all_reset_captures_again():
    """The graph's output is still held when the graph is reset: torch keeps the pool at use count 0 and a capture
    into it failed create_or_incref_pool's internal assert (use_count > 0)."""
    from cgcompile.runtime.drivers.cuda import CudaDriver

    driver = CudaDriver(torch.device("cuda"))
    token = driver.new_pool()
    x = torch.randn(64, 64, device="cuda")
    old = driver.capture(lambda a: [a[0] @ a[0]], [x], token)
    held = old.replay()[0]
    old.release()
    new = driver.capture(lambda a: [a[0] + 1], [x], token)
    torch.testing.assert_close(new.replay()[0], x + 1)
    torch.testing.assert_close(held, x @ x)  # the old output's memory was not handed to the new graph


def test_a_single_graph_frame_whose_parameter_moved_is_captured_again():
    """One graph in the frame's shared pool, its output kept (clone_outputs off), the parameter moves before the
    graph was used twice: the re-capture goes to the same token, whose only graph was just dropped."""
    model = torch.nn.Linear(16, 16).cuda()
    run = torch.compile(model, backend="cudagraph_modules",  # min_partition_ops 1: one linear captured, not too small
                        options={"driver": "cuda", "cuda_graph_warmup_steps": 1, "clone_outputs": False,
                                 "inner_compiler": "eager", "min_partition_ops": 1})
    cgcompile.reset_stats()
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        run(x)
        kept = run(x)  # captured and replayed once: the capture wave is still open
        model.weight.data = model.weight.data.clone() * 2
        torch.testing.assert_close(run(x), model(x))
        torch.testing.assert_close(run(x), model(x))
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [] and len(st["recaptures"]) >= 1, st
    assert kept.shape == (4, 16)


def test_every_address_check_available_on_a_cuda_build_agrees_on_cuda_tensors():
    """CUDA builds have torch's own one-call check besides cgcompile's compiled helper: both (and the Python
    fallback) answer what data_ptr() comparisons answer, for CUDA parameters, moved or not."""
    from cgcompile import _compat

    assert "torch" in _compat.ADDRESS_CHECK_IMPLS
    args = [torch.nn.Parameter(torch.randn(8, device="cuda")) for _ in range(6)]
    indices = [0, 2, 3, 5]
    checks = {impl: _compat.AddressCheck(indices, [args[i].data_ptr() for i in indices], impl)
              for impl in _compat.ADDRESS_CHECK_IMPLS}
    assert all(check.matches(args) for check in checks.values())
    args[3].data = args[3].data.clone()
    assert not any(check.matches(args) for check in checks.values())
    assert all(check.matches(args) for check in {
        impl: _compat.AddressCheck([0, 2], [args[0].data_ptr(), args[2].data_ptr()], impl)
        for impl in _compat.ADDRESS_CHECK_IMPLS}.values())

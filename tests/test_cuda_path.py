"""The CUDA path's decisions, checked on the CPU (the CUDA twins are in tests/gpu): which device a frame's
streams, pools and captures belong to (with its index), which pool a capture into a token really uses, and what
torch's version says about random generators in captures. Fake CUDA tensors (FakeTensorMode) carry devices
without a GPU."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cgcompile.backend import compile_frame
from cgcompile.frame_plan import make_plan
from cgcompile.config import CudaGraphConfig
from cgcompile.runtime.drivers.cuda import CudaDriver
from cgcompile.devices import device_of
from cgcompile.runtime.drivers.select import captures_on
from cgcompile.runtime.local.model_runtime import ModelRuntime

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def fake(*shape, device):
    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(*shape, device=device)


def test_the_frame_device_keeps_its_index():
    """A model on cuda:1 (its parameters) called with a cuda:1 batch while the current device is 0."""
    params = [fake(4, 4, device=CUDA1) for _ in range(3)]
    assert device_of([fake(2, 4, device=CUDA1), *params, 3, torch.tensor(1.0)]) == CUDA1
    assert device_of([fake(2, 4, device=CUDA0), *params]) == CUDA1  # the parameters' device wins
    assert device_of([fake(2, device=CUDA1), fake(2, device=CUDA0)]) == CUDA1  # a tie: the first
    assert device_of([torch.ones(2), 3]) == torch.device("cpu")


def test_a_partition_is_captured_only_on_its_own_device():
    assert captures_on(CUDA1, [fake(2, device=CUDA1), torch.tensor(2.0), 3])
    assert not captures_on(CUDA1, [fake(2, device=CUDA1), fake(2, device=CUDA0)])  # cuda:0 kernels: not recorded
    assert not captures_on(CUDA1, [torch.ones(2)])  # no CUDA tensor: nothing to capture
    assert CudaDriver(CUDA1).device == CUDA1  # an explicit index is kept, never replaced by the current device


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


def test_the_backend_hands_the_runtime_the_device_with_its_index():
    """compile_frame used to build ModelRuntime(torch.device("cuda")): the driver then took the current device."""
    seen = []

    def grab(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    torch.compile(_Linear(), backend=grab)(torch.randn(2, 4))
    gm, example_inputs = seen[0]
    on_cuda1 = [fake(*t.shape, device=CUDA1) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    config = CudaGraphConfig.from_options({"driver": "emulate", "cuda_graph_modules": []})
    plan = make_plan(gm, example_inputs, config, 0)
    plan.device = device_of(on_cuda1).type
    run = compile_frame(gm, on_cuda1, plan, config)  # captures lazily: nothing runs here
    assert run.runtime.device == CUDA1
    assert ModelRuntime(config, CUDA1).device == CUDA1


def test_which_torch_releases_leave_the_default_generator_in_capture_mode():
    """Read in the CUDA builds of 2.11.0, 2.12.0 and 2.13.0 (see _compat): only 2.11's one capture flag per
    generator outlives a failed capture; a 2.12 pre-release counts as 2.11 (the undo is harmless there)."""
    from cgcompile import _compat

    assert _compat.generator_capture_state_outlives_failure("2.11.0+cu130")
    assert _compat.generator_capture_state_outlives_failure("2.12.0a0+git1234")
    assert not _compat.generator_capture_state_outlives_failure("2.12.0")
    assert not _compat.generator_capture_state_outlives_failure("2.13.0+cu130")


@pytest.mark.parametrize("torch_message", [
    "RNG op during graph capture but generator is not registered with the capturing graph. Call "
    "graph.register_generator_state() before capture_begin().",  # 2.12, 2.13
    "Attempt to increase offset for a CUDA generator not in capture mode.",  # 2.11
])
def test_a_capture_that_draws_from_an_own_generator_says_how_to_fix_it(torch_message):
    from cgcompile.runtime.drivers.cuda import capture_failure

    text = str(capture_failure(RuntimeError(torch_message)))
    assert text.startswith(f"CUDA graph capture failed: {torch_message}")
    assert "torch.Generator of its own" in text and "torch.manual_seed" in text and "eager_region" in text
    assert "torch.Generator" not in str(capture_failure(RuntimeError("operation not permitted when stream is "
                                                                      "capturing")))


class _Tokens(CudaDriver):
    """The CUDA driver with pool tokens a CPU build can make (torch.cuda.graph_pool_handle needs CUDA); the
    bookkeeping under test is the driver's own."""

    def __init__(self):
        super().__init__(CUDA0)
        self.made = 0

    def new_pool(self):
        self.made += 1
        return (0, self.made)


class _Graph:
    """Stands in for a captured graph as the ledger sees it: an object that lives and dies."""


def test_a_token_whose_graphs_were_all_reset_gets_a_fresh_pool():
    """torch keeps a pool whose graphs were all reset at use count 0 while any of its blocks is allocated (a
    kept output), and asserts use_count > 0 at the next capture into it: e.g. a single-graph frame whose
    parameter moved drops its graph, then captures again with the same token."""
    driver = _Tokens()
    token = driver.new_pool()
    assert driver.pool_for_capture(token) == token  # never used: torch creates it at the first capture
    first, second = _Graph(), _Graph()
    release_first = driver.pools.track(first, token)
    driver.pools.track(second, token)
    release_first()
    release_first()  # a graph's release and its collection count once
    del first
    assert driver.pool_for_capture(token) == token  # one graph still holds it: shared as before
    del second  # the last one goes (collected without an explicit reset)
    fresh = driver.pool_for_capture(token)
    assert fresh != token and driver.pool_for_capture(token) == fresh  # the token keeps its new pool
    third = _Graph()
    driver.pools.track(third, fresh)
    assert driver.pool_for_capture(token) == fresh and driver.pools.live_graphs(fresh) == 1
    assert driver.pool_for_capture(None) not in (token, fresh)  # no token: a private pool

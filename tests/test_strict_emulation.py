"""The emulate driver enforces the CUDA-graph contract as strictly as a CPU can (runtime/drivers/emulate.py):
values baked at capture, external tensors read in place, memory pools overwritten by earlier graphs' replays,
host syncs the capture guard must see, higher-order operators."""

import copy

import pytest
import torch
import torch.nn as nn

import cgcompile
from cgcompile.rewrites.padding import nonzero_bucketed
from cgcompile.runtime.drivers.base import CaptureError, StaleReplayError
from cgcompile.runtime.drivers.emulate import EmulateDriver

HERE = __file__.rsplit("/", 1)[-1]


# --- values baked at capture --------------------------------------------------------------------------------


def test_a_python_scalar_changed_after_capture_is_refused_naming_the_op_and_line():
    scale = {"value": 2.0}
    graph = EmulateDriver().capture(lambda a: [a[0] * scale["value"]], [torch.ones(3)])
    assert torch.equal(graph.replay()[0], torch.full((3,), 2.0))
    scale["value"] = 3.0  # a CUDA graph would keep multiplying by 2
    with pytest.raises(StaleReplayError, match=r"aten\.mul\.Tensor with argument 1 = 3\.0 where its capture had 2\.0"
                                               r".*" + HERE):
        graph.replay()


def test_a_replaced_closed_over_tensor_is_refused_and_one_written_in_place_is_read():
    state = {"bias": torch.zeros(3)}
    graph = EmulateDriver().capture(lambda a: [a[0] + state["bias"]], [torch.ones(3)])
    state["bias"].fill_(5.0)  # the same memory: the graph reads the new values, as on a GPU
    assert torch.equal(graph.replay()[0], torch.full((3,), 6.0))
    state["bias"] = torch.zeros(3)  # another tensor: a CUDA graph still reads the old address
    with pytest.raises(StaleReplayError, match="a tensor the graph computes where its capture had an external tensor"):
        graph.replay()


def test_another_op_sequence_is_refused():
    flag = {"relu": False}

    def fn(a):
        return [torch.relu(a[0]) if flag["relu"] else a[0] * 1.0]

    graph = EmulateDriver().capture(fn, [torch.ones(3)])
    flag["relu"] = True
    with pytest.raises(StaleReplayError, match="took another path than at capture"):
        graph.replay()


def _sgd_loop(lr, scheduled: bool, steps: int = 7):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    results = []
    for net, capture in ((model, True), (reference, False)):
        opt = torch.optim.SGD(net.parameters(), lr=lr() if callable(lr) else lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if scheduled else None

        def step(x, y, net=net, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = (net(x) - y).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()

        run = cgcompile.capture_step(step, warmup_steps=1, driver="emulate") if capture else step
        losses = []
        for i in range(steps):
            g = torch.Generator().manual_seed(i)
            losses.append(run(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)))
            if sched is not None:
                sched.step()
        results.append((losses, [p.detach().clone() for p in net.parameters()]))
    return results


def test_capture_step_captures_again_when_a_scheduler_changes_a_float_lr():
    cgcompile.reset_stats()
    (losses, params), (ref_losses, ref_params) = _sgd_loop(0.1, scheduled=True)
    for a, b in zip(losses + params, ref_losses + ref_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    reasons = [r["reason"] for r in cgcompile.stats()["recaptures"] if r["partition"] == "capture_step"]
    assert len(reasons) == 2 and reasons[0].startswith("SGD param group 0 'lr': 0.1 -> 0.05 since the step")


def test_capture_step_reads_a_tensor_lr_at_each_replay_without_capturing_again():
    """What AdamW(lr=tensor, capturable=True) does on a GPU (not on CPU: torch allows capturable only on
    accelerators): the update reads the lr tensor, which the schedule writes in place."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    reference = copy.deepcopy(model)
    lr = torch.tensor(0.1)

    def step(net, x):
        net.zero_grad(set_to_none=True)
        loss = net(x).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in net.parameters():
                p.sub_(lr * p.grad)
        return loss.detach()

    run = cgcompile.capture_step(lambda x: step(model, x), warmup_steps=1, driver="emulate")
    cgcompile.reset_stats()
    for i in range(6):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        lr.fill_(0.1 / (i + 1))
        torch.testing.assert_close(run(x), step(reference, x), rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    st = cgcompile.stats()
    assert st["recaptures"] == [] and st["graphs_captured"] == 1 and st["steady_replays"] == 4


def test_capture_step_refuses_sgd_with_a_tensor_lr_at_the_first_call():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))

    def step(x):
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    with pytest.raises(cgcompile.ConfigError, match=HERE + r":\d+: aten._local_scalar_dense"):
        cgcompile.capture_step(step, driver="emulate")(torch.ones(2, 4))


def test_capture_step_runs_eagerly_when_the_lr_changes_every_step():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))

    def step(x):
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    run = cgcompile.capture_step(step, warmup_steps=1, driver="emulate")
    cgcompile.reset_stats()
    for _ in range(8):
        run(torch.ones(2, 4))
        sched.step()
    st = cgcompile.stats()
    (fallback,) = st["eager_fallbacks"]
    assert fallback["partition"] == "capture_step" and "re-captured 3 times in a row" in fallback["reason"]
    assert len(st["recaptures"]) == 2


# --- host syncs the capture guard sees ------------------------------------------------------------------------


def _define_python_sync_op():
    if hasattr(torch.ops.cgtest, "reads_host"):
        return
    torch.library.define("cgtest::reads_host", "(Tensor x, int how) -> Tensor")

    @torch.library.impl("cgtest::reads_host", "CompositeExplicitAutograd")
    def _reads_host(x, how):
        if how == 0:
            x.tolist()
        elif how == 1:
            x.cpu()
        elif how == 2:
            bool(x.sum() > 0)
        return x * 2


_define_python_sync_op()


@pytest.mark.parametrize("fn, what", [
    (lambda a: [torch.tensor(float(torch.equal(a[0], a[0])))], "aten.equal"),
    (lambda a: [torch.linalg.inv(a[1])], "error codes"),
    (lambda a: [torch.histc(a[0], bins=4)], "histc"),
    (lambda a: nonzero_bucketed([a[0] > 0], []), "int(tensor)"),
    (lambda a: [a[0] + torch.tensor([1.0, 2.0, 3.0])], "torch.tensor"),
    (lambda a: [torch.ops.cgtest.reads_host(a[0], 0)], "Tensor.tolist()"),
    (lambda a: [torch.ops.cgtest.reads_host(a[0], 1)], "Tensor.cpu()"),
    (lambda a: [torch.ops.cgtest.reads_host(a[0], 2)], "bool(tensor)"),
    (lambda a: [torch.cuda.synchronize(), a[0]][1:], "torch.cuda.synchronize()"),
], ids=["equal", "linalg", "histc", "nonzero_bucketed", "host_data", "tolist", "cpu", "bool", "synchronize"])
def test_the_capture_guard_sees_each_host_sync(fn, what):
    with pytest.raises(CaptureError, match="not permitted when stream is capturing") as failure:
        EmulateDriver().capture(fn, [torch.randn(3), torch.eye(2)])
    assert what in str(failure.value)
    assert "tolist" not in vars(torch.Tensor) and torch.ones(2).tolist() == [1.0, 1.0]  # the guard's patches are gone


def test_a_host_to_device_copy_is_a_sync_on_cuda_unless_pinned_and_non_blocking():
    from cgcompile.runtime.drivers.host_sync import host_sync_reason

    with torch._subclasses.FakeTensorMode():
        gpu, host = torch.empty(3, device="cuda"), torch.empty(3)
        assert "copies pageable" in host_sync_reason(torch.ops.aten.copy_.default, (gpu, host), {}, True)
        assert "to the CPU" in host_sync_reason(torch.ops.aten.copy_.default, (host, gpu), {}, True)
        assert host_sync_reason(torch.ops.aten._to_copy.default, (host,), {"device": torch.device("cuda")}, True)
        assert host_sync_reason(torch.ops.aten.copy_.default, (gpu, gpu), {}, True) is None


def test_capture_and_replay_bump_no_version_counter_of_an_input_they_write():
    """A CUDA graph's kernels bump no version counter: neither may the emulated capture or replay of a graph that
    writes a cache in place (the runtime bumps it, as aot's wrapper does; test_steady_replay checks that)."""
    cache = torch.zeros(4)
    alias = cache.detach()  # how the runtime holds an input read in place: it shares the version counter

    def write(a):
        a[0].add_(1.0)
        return [a[0] * 2]

    before = cache._version
    graph = EmulateDriver().capture(write, [alias], written=[0])
    assert torch.equal(cache, torch.zeros(4)) and cache._version == before  # nothing of the capture is left
    graph.replay()
    graph.replay()
    assert torch.equal(cache, torch.full((4,), 2.0)) and cache._version == before  # written, no version bumped


# --- memory pools ---------------------------------------------------------------------------------------------


def test_a_replay_overwrites_the_memory_of_graphs_captured_after_it_in_its_pool():
    driver = EmulateDriver()
    pool, x = driver.new_pool(), torch.ones(3)
    first = driver.capture(lambda a: [a[0] * 2], [x], pool)
    later = driver.capture(lambda a: [a[0] + 1], [x], pool)
    private = driver.capture(lambda a: [a[0] - 1], [x], driver.new_pool())
    held_later, held_private = later.replay()[0], private.replay()[0]
    first.replay()  # its temporaries may lie where `later` keeps its output (captured after it, same pool)
    assert torch.isnan(held_later).all() and torch.equal(held_private, torch.zeros(3))
    assert torch.equal(later.replay()[0], torch.full((3,), 2.0))
    later.replay()
    assert torch.equal(first.static_outputs[0], torch.full((3,), 2.0))  # a later graph never overwrites an earlier


class _Scale(nn.Module):
    def forward(self, x):
        return x * 2.0 + 1.0  # no parameter, nothing saved for backward: idle once its output is consumed


class _ExpScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, y):
        return y.exp() * self.w  # saves exp(y): its own output, pending until its backward


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = cgcompile.tag("attn")(_Scale()), cgcompile.tag("mlp")(_ExpScale())

    def forward(self, x):
        return self.b(self.a(x))


def _accumulated_grads(model, steps=3):
    """fwd, fwd, bwd, bwd: the second forward runs while the first's saved tensors are still needed."""
    grads = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(step)
        losses = [model(torch.randn(4, 6, generator=g)).square().mean() for _ in range(2)]
        for loss in losses:
            loss.backward()
        grads.append(model.b.w.grad.clone())
    return grads


@pytest.mark.parametrize("pool_rule", [True, False], ids=["pool_rule", "no_pool_rule"])
def test_the_pool_rule_is_what_keeps_accumulation_exact(pool_rule, monkeypatch):
    """The runtime's pool rule (a shared-pool graph never replays while a later one is busy) is checked by the
    emulated pools: without it, the first partition's replay in the second forward overwrites the saved tensors
    of the second partition's first call, and its backward would read garbage (without emulated pools, the
    broken rule goes unnoticed: checked when this test was written)."""
    from cgcompile.runtime.memory.registry import MemoryRegistry

    if not pool_rule:
        monkeypatch.setattr(MemoryRegistry, "pool_blocker", lambda self, graph: None)
    torch.manual_seed(0)
    model, reference = _Pair(), _Pair()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="cudagraph_modules", options={
        "cuda_graph_modules": ["attn", "mlp"], "driver": "emulate", "cuda_graph_warmup_steps": 1,
        "min_partition_ops": 1, "strict_modules": True})
    want = _accumulated_grads(reference)
    if pool_rule:
        for a, b in zip(_accumulated_grads(_Through(compiled, model)), want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:  # the overwritten saved tensor: autograd sees its version bumped (a GPU would read garbage silently)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _accumulated_grads(_Through(compiled, model))


class _Through(nn.Module):
    """Calls the compiled model, exposes the eager model's parameters (for zero_grad and .b.w.grad)."""

    def __init__(self, compiled, model):
        super().__init__()
        self.compiled, self.b = compiled, model.b

    def forward(self, x):
        return self.compiled(x)

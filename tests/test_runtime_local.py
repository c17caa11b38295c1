"""The local runtime's public API (ModelRuntime, compile_partition) on single partitions, CPU + emulate."""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
import torch._functorch.config as functorch_config
import torch.nn as nn

from cgcompile import stats
from cgcompile.config import CudaGraphConfig
from cgcompile.runtime import ModelRuntime, compile_partition
from cgcompile.runtime.local.sources import source_of


def runtime(**options) -> ModelRuntime:
    opts = {"driver": "emulate", "cuda_graph_warmup_steps": 1}
    opts.update(options)
    return ModelRuntime(CudaGraphConfig.from_options(opts), "cpu")


def graphs_of(p, kind=None):
    """The live captured graphs of partition runner p (of one kind: forward, backward, inference)."""
    return [g for g in p.runtime.live_graphs() if g.partition == p.name and kind in (None, g.kind)]


def partition(fn_or_module, rt, name="p", static=(), examples=()):
    gm = fx.symbolic_trace(fn_or_module)
    return compile_partition(gm, list(examples), name=name, static_input_indices=list(static), runtime=rt,
                             location="test_runtime_local.py")


class MLP(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def twins(cls=MLP, seed=0):
    torch.manual_seed(seed)
    a, b = cls(), cls()
    b.load_state_dict(a.state_dict())
    return a, b


def assert_close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class CountCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the runtime's copy-ins: aten.copy_ into a static input buffer of the given partitions' graphs
    (emulate's own writes go to static outputs and are not counted)."""

    def __init__(self, *partitions):
        super().__init__()
        self.targets = {id(t) for p in partitions for g in graphs_of(p) if g.kind != "backward"
                        for t in g.captured.static_inputs}
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and id(args[0]) in self.targets:
            self.copies += 1
        if func is torch.ops.aten._foreach_copy_.default:  # the runtime copies a call's inputs in one dispatch
            self.copies += sum(id(t) in self.targets for t in args[0])
        return func(*args, **(kwargs or {}))


def test_calling_convention_single_tuple_and_list():
    rt = runtime()
    single = partition(lambda x: x * 2, rt, "single")
    pair = partition(lambda x: (x + 1, x * 3), rt, "pair")
    listed = partition(lambda x: [x - 1], rt, "listed")
    x = torch.randn(3)
    for _ in range(3):
        assert torch.equal(single(x), x * 2)
        a, b = pair(x)
        assert isinstance(pair(x), tuple) and torch.equal(a, x + 1) and torch.equal(b, x * 3)
        out = listed(x)
        assert isinstance(out, list) and torch.equal(out[0], x - 1)
    assert stats()["steady_replays"] > 0


def test_eager_driver_with_eager_compiler_returns_the_submodule():
    gm = fx.symbolic_trace(MLP())
    rt = runtime(driver="eager")
    assert compile_partition(gm, [], name="p", static_input_indices=[], runtime=rt) is gm
    rt = ModelRuntime(CudaGraphConfig.from_options({}), "cpu")  # auto on CPU = eager
    assert compile_partition(gm, [], name="p", static_input_indices=[], runtime=rt) is gm


def test_forward_backward_parity_and_held_gradient_buffers():
    ref, model = twins()
    rt = runtime()
    p = partition(model, rt)
    for step in range(4):  # no zero_grad: grads accumulate across steps
        x = torch.randn(5, 6)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        p(x1).pow(2).sum().backward()
        ref(x2).pow(2).sum().backward()
        assert_close(x1.grad, x2.grad)
        for a, b in zip(model.parameters(), ref.parameters()):
            assert_close(a.grad, b.grad)
            assert not rt.memory.owns(a.grad)  # AccumulateGrad copied, never stole a static buffer
    s = stats()
    assert s["graphs_captured"] == 2 and s["steady_replays"] == 4  # fwd+bwd captured at step 1, run again at 2, 3


def _step(model, p, ref, x, zero=True):
    """One training step of partition p (wrapping model) and of ref on the same input; grads compared."""
    p(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_close(a.grad, b.grad)
    if zero:
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def test_cleared_grads_are_stolen_and_kept_grads_stay_exact():
    """A loop that clears grads gets them as the backward graph's memory (no clone per parameter); once a
    loop keeps them (accumulation, set_to_none=False) the graph copies again and every grad stays exact."""
    ref, model = twins()
    rt = runtime()
    p = partition(model, rt)
    for step in range(4):
        p(torch.randn(5, 6)).pow(2).sum().backward()
        stolen = [rt.memory.owns(a.grad) for a in model.parameters()]
        model.zero_grad(set_to_none=True)
    assert all(stolen)  # grads cleared before two replays in a row: AccumulateGrad kept the graph's outputs
    for step in range(3):  # accumulation: the first micro-step's grads are held through the second
        for micro in range(2):
            x = torch.randn(5, 6)
            p(x).pow(2).sum().backward()
            ref(x).pow(2).sum().backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            assert_close(a.grad, b.grad)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    for step in range(3):  # grads zeroed in place: they stay allocated between steps
        _step(model, p, ref, torch.randn(5, 6), zero=False)
        model.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
    assert not any(rt.memory.owns(a.grad) for a in model.parameters())
    assert stats()["steady_replays"] > 8 and not stats()["eager_fallbacks"]


@functorch_config.patch(donated_buffer=False)  # else aot itself refuses retain_graph
def test_second_backward_through_one_forward_never_overwrites_stolen_grads():
    """retain_graph: the second backward of the same forward instance finds its graph's grads held as .grad
    and runs eagerly; the sum is eager's."""
    ref, model = twins()
    rt = runtime()
    p = partition(model, rt)
    for step in range(4):
        _step(model, p, ref, torch.randn(5, 6))
    x = torch.randn(5, 6)
    loss, ref_loss = p(x).pow(2).sum(), ref(x).pow(2).sum()
    loss.backward(retain_graph=True)
    ref_loss.backward(retain_graph=True)
    assert all(rt.memory.owns(a.grad) for a in model.parameters())  # the first one was stolen
    for a, b in zip(model.parameters(), ref.parameters()):  # e.g. clipped: .grad is no longer what was replayed
        a.grad.mul_(0.5), b.grad.mul_(0.5)
    loss.backward()
    ref_loss.backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_close(a.grad, b.grad)


def test_stolen_grads_held_keep_earlier_shared_pool_graphs_from_replaying():
    """The second partition's grads live in its backward graph's memory; an earlier graph of the same pool
    must not replay (its temporaries may overlap that memory) while they are held."""
    ref_a, a = twins(seed=1)
    ref_b, b = twins(seed=2)
    rt = runtime()
    first, second = partition(a, rt, "first"), partition(b, rt, "second")

    def run(x):
        return second(first(x)).pow(2).sum()

    for step in range(4):
        x = torch.randn(5, 6)
        run(x).backward()
        ref_b(ref_a(x)).pow(2).sum().backward()
        if step < 3:
            for m in (a, b, ref_a, ref_b):
                m.zero_grad(set_to_none=True)
    assert all(rt.memory.owns(q.grad) for q in b.parameters())  # stolen, and held into the next step

    def step_matches_eager():
        x = torch.randn(5, 6)
        run(x).backward()
        ref_b(ref_a(x)).pow(2).sum().backward()
        for m, r in ((a, ref_a), (b, ref_b)):
            for q, q_ref in zip(m.parameters(), r.parameters()):
                assert_close(q.grad, q_ref.grad)

    step_matches_eager()
    # that call ran eagerly instead of capturing another instance: the backward graph whose grads the loop keeps
    # hands out copies from then on. The grads stolen before stay graph memory (never zeroed here), so the pool
    # rule keeps instance 0 waiting: one more instance serves the later steps, and the count stays there
    assert len(graphs_of(first, "forward")) == 1
    for _ in range(3):
        step_matches_eager()
    assert len(graphs_of(first, "forward")) == 2 and graphs_of(first, "forward")[1].replays == 3


def test_parameters_are_not_copied_and_inputs_are():
    model = MLP()
    rt = runtime()
    p = partition(model, rt)
    x = torch.randn(5, 6)
    with torch.no_grad():
        for _ in range(3):
            p(x)
        with CountCopies(p) as counter:
            p(x)
        assert counter.copies == 1  # x only; four parameters read in place
        graph = graphs_of(p, "inference")[0]
        buffer = graph.captured.static_inputs[graph.copied_inputs[0]]
        expected = model(buffer.clone())
        with CountCopies(p) as counter:
            out = p(buffer)  # our own static buffer passed back: copied onto itself, in the same one dispatch
        assert counter.copies == 1
        assert_close(out, expected)


def test_previous_partitions_static_output_is_borrowed_not_copied():
    rt = runtime()
    first = partition(lambda x: torch.relu(x) + 1, rt, "first")
    second = partition(lambda h: h * h, rt, "second")
    x = torch.randn(8)
    with torch.no_grad():
        for _ in range(3):
            second(first(x))  # outputs dropped: a held output would keep its graph busy
        with CountCopies(first, second) as counter:
            out = second(first(x))
        assert counter.copies == 1  # x into first's buffer; first's output is read in place by second
        assert rt.memory.owns(out) and torch.equal(out, (torch.relu(x) + 1) ** 2)
        assert stats()["graphs_captured"] == 2


def test_graph_bank_keys_on_shape_dtype_and_grad_mode():
    rt = runtime()
    p = partition(lambda x: (x * 2).sin(), rt)
    inputs = [torch.randn(3), torch.randn(4), torch.randn(3, dtype=torch.float64), torch.randn(3)]
    for _ in range(3):
        for x in inputs:
            assert torch.equal(p(x), (x * 2).sin())
            with torch.no_grad():
                assert torch.equal(p(x), (x * 2).sin())
    assert p.bank_size() == 6  # 3 signatures x {grad, no_grad}
    assert stats()["graphs_captured"] == 6


def test_static_input_address_change_recaptures():
    rt = runtime()
    w = torch.randn(4)
    p = partition(lambda x, w: x * w, rt, static=[1])
    x = torch.randn(4)
    for _ in range(3):
        assert torch.equal(p(x, w), x * w)
    w.data = torch.randn(4)  # same parameter object, new address
    assert torch.equal(p(x, w), x * w)  # re-captured, not stale
    s = stats()
    assert len(s["recaptures"]) == 1 and s["recaptures"][0]["partition"] == "p"
    assert "moved" in s["recaptures"][0]["reason"]
    assert torch.equal(p(x, w), x * w)
    assert len(stats()["recaptures"]) == 1 and stats()["graphs_captured"] == 2


def test_one_partition_serving_several_parameter_sets():
    """Dynamo reuses one compiled frame for every layer when layers graph-break: one graph per layer."""
    rt = runtime(max_graphs_per_partition=1)
    layers = [torch.randn(4) for _ in range(3)]
    p = partition(lambda x, w: (x * w).sin(), rt, static=[1])
    x = torch.randn(4)
    with torch.no_grad():
        for step in range(3):
            for w in layers:
                assert torch.equal(p(x, w), (x * w).sin())
    s = stats()
    assert s["graphs_captured"] == 3 and s["recaptures"] == [] and s["eager_fallbacks"] == []


def test_same_partition_twice_in_one_step():
    """A reused layer: the second call must not overwrite what the first call's backward needs."""
    ref, model = twins()
    rt = runtime()
    p = partition(model, rt)
    for step in range(4):
        model.zero_grad(), ref.zero_grad()
        x = torch.randn(5, 6)
        p(p(x)).sum().backward()
        ref(ref(x)).sum().backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            assert_close(a.grad, b.grad)
    s = stats()
    assert s["graphs_captured"] == 4 and s["eager_fallbacks"] == []  # two instances, each fwd+bwd


def test_backwards_in_either_order_find_their_instances_by_one_tagged_alias():
    """Three instances replayed in one step find their backwards in either order. A forward replay hands out an
    alias per output (saved activations included: dozens per decoder layer); the backward finds its instance by
    one it reads, so once the first backward showed which, only that alias is tagged (GraphFamily.marker)."""
    ref, model = twins()
    rt = runtime()
    p = partition(model, rt)
    for step in range(4):
        model.zero_grad(), ref.zero_grad()
        xs = [torch.randn(5, 6) for _ in range(3)]
        losses = [p(x).pow(2).sum() for x in xs]
        ref_losses = [ref(x).pow(2).sum() for x in xs]
        if step == 3:
            forwards = graphs_of(p, "forward")
            tagged = [[a is not None and source_of(a) is g for a in g.handed_aliases()] for g in forwards]
        for loss in (losses if step % 2 else reversed(losses)):
            loss.backward()
        for loss in ref_losses:
            loss.backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            assert_close(a.grad, b.grad)
    # 3 instances, forward and backward; the two backward graphs captured before the third forward, which is held
    # whenever they replay in the reversed order, captured again after it (the pool rule)
    assert stats()["graphs_captured"] == 8
    assert len(forwards) == 3 and all(len(flags) > 2 for flags in tagged)  # output, saved activations
    assert [sum(flags) for flags in tagged] == [1, 1, 1]
    backwards = graphs_of(p, "backward")
    assert len(backwards) == 3 and all(g.replays >= 2 for g in backwards)  # found by the one tag since step 2


def test_discarded_loss_frees_the_instance():
    model = MLP()
    rt = runtime()
    p = partition(model, rt)
    for _ in range(5):
        p(torch.randn(5, 6)).sum()  # forward only, graph dropped
    assert stats()["graphs_captured"] == 1


def test_bank_cap_runs_eagerly_and_logs_once(caplog):
    rt = runtime(max_graphs_per_partition=2)
    p = partition(lambda x: x.exp(), rt)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        xs = [torch.randn(3, requires_grad=True) for _ in range(6)]
        held = [p(x) for x in xs]  # backwards pending on every output keep every instance held
    for x, out in zip(xs, held):
        assert torch.equal(out, x.exp())
    s = stats()
    assert s["graphs_captured"] == 2
    assert len(s["eager_fallbacks"]) == 1 and "max_graphs_per_partition=2" in s["eager_fallbacks"][0]["reason"]
    assert sum("max_graphs_per_partition" in r.getMessage() for r in caplog.records) == 1


def test_compile_failure_falls_back_with_location(caplog):
    rt = runtime()
    p = partition(lambda x: x * x.sum().item(), rt, "syncing")  # aot cannot trace .item() without a shape env
    x = torch.randn(4)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for _ in range(3):
            assert torch.equal(p(x), x * x.sum().item())
    s = stats()
    assert [f["partition"] for f in s["eager_fallbacks"]] == ["syncing"]
    records = [r.getMessage() for r in caplog.records if "syncing" in r.getMessage()]
    assert len(records) == 1 and "test_runtime_local.py" in records[0]


def test_finish_frame_outputs_clones_only_static_memory():
    rt = runtime()
    p = partition(lambda x: x + 1, rt)
    x = torch.randn(3)
    with torch.no_grad():
        for _ in range(3):
            p(x)  # outputs dropped at once (one kept across calls would be handed out as a copy)
        out = p(x)
    plain = torch.randn(2)
    assert rt.memory.owns(out) and not rt.memory.owns(plain) and not rt.memory.owns(None)
    a, b, c = rt.finish_frame_outputs((out, plain, 3))
    assert not rt.memory.owns(a) and torch.equal(a, out) and b is plain and c == 3
    assert not rt.memory.owns(rt.finish_frame_outputs(out))
    rt_keep = runtime(clone_outputs=False)
    assert rt_keep.finish_frame_outputs((out,))[0] is out


def test_every_capture_shares_the_runtimes_pool_and_the_wave_is_summarised_once(caplog):
    rt = runtime()
    first = partition(lambda x: x.sin(), rt, "first")
    second = partition(lambda x: x.cos(), rt, "second")
    with caplog.at_level(logging.INFO, logger="cgcompile"), torch.no_grad():
        for _ in range(3):
            second(first(torch.randn(4)))
        for _ in range(2):
            second(first(torch.randn(5)))  # a new shape after the wave: warmup call, then capture
    graphs = sorted((g for p in (first, second) for g in graphs_of(p, "inference")), key=lambda g: g.pool_position)
    assert [g.pool_position for g in graphs] == [0, 1, 2, 3]  # in capture order, in one pool
    assert len({id(g.captured.pool) for g in graphs}) == 1
    summary = [r.getMessage() for r in caplog.records if "captured 2 graphs" in r.getMessage()]
    assert len(summary) == 1


def test_progress_display_for_a_long_capture_wave(monkeypatch, capsys, caplog):
    from cgcompile.runtime.local import model_runtime
    monkeypatch.setattr(model_runtime, "PROGRESS_AFTER_S", -1.0)  # every capture counts as "long"
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # the plain stderr fallback
    rt = runtime()
    parts = [partition(lambda x: x * 2, rt, f"p{i}") for i in range(3)]
    with caplog.at_level(logging.INFO, logger="cgcompile"), torch.no_grad():
        for _ in range(3):
            for p in parts:
                p(torch.randn(3))
    assert "capturing CUDA graphs... 1 captured" in capsys.readouterr().err
    assert sum("captured 3 graphs" in r.getMessage() for r in caplog.records) == 1


def test_shared_pool_graph_waits_while_a_later_graph_is_busy():
    """fwd, fwd, bwd, bwd where the first partition saves nothing: replaying it while the second
    partition's first-microbatch activations live could scribble over them in a shared pool."""
    rt = runtime()
    first = partition(lambda x: x * 2, rt, "first")  # saves nothing for backward
    second = partition(lambda h: (h + 1).exp(), rt, "second")  # saves only its own output
    for step in range(3):
        xs = [torch.randn(4, requires_grad=True) for _ in range(2)]
        losses = [second(first(x)).sum() for x in xs]
        for loss, x in zip(losses, xs):
            loss.backward()
            assert_close(x.grad, 2 * (2 * x.detach() + 1).exp())
    assert len(graphs_of(first, "forward")) == 2  # the second microbatch could not reuse instance 0

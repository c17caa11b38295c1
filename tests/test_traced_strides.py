"""Values whose real strides differ from the ones aot_autograd traced (runtime/local/traced_strides.py).

torch 2.13's meta kernels of `log_sigmoid_forward` and `softplus_backward` give other strides than the CPU/CUDA
kernels for a transposed input, so aot plans a `view` that the real value cannot take: in the forward (and
inference) graph after `logsigmoid`, in the backward graph after `softplus`'s gradient (Qwen3-Next's gated
delta-net, tests/hf/test_hf_qwen3_next.py). The model below trains and evaluates like eager, in the eager warmup
and in replayed graphs."""

import copy

import torch
import torch.nn.functional as F

import cgcompile
from cgcompile.runtime.local.traced_strides import traced_layout_differs

OPTIONS = {"driver": "emulate", "cuda_graph_warmup_steps": 1}
STEPS = 4


class TransposedActivations(torch.nn.Module):
    """logsigmoid and softplus applied to transposed activations, each followed by a reshape."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.gate = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        h = self.proj(x).view(2, 8, 4)
        forward_trap = F.logsigmoid(h.transpose(1, 2)).transpose(1, 2).reshape(16, 4)
        backward_trap = F.softplus(h).transpose(1, 2) * self.gate  # its gradient reaches softplus transposed
        return forward_trap.square().sum() + backward_trap.sum()


def test_the_meta_kernels_still_disagree_with_the_cpu_kernels():
    """The premise of the tests below: if torch fixes these metas, they no longer exercise the restride."""
    aten = torch.ops.aten
    grad, x = torch.randn(2, 4, 8).transpose(1, 2), torch.randn(2, 8, 4)
    for op in (lambda g, t: aten.softplus_backward(g, t, 1, 20), lambda g, t: aten.log_sigmoid_forward(g)[0]):
        real, meta = op(grad, x), op(grad.to("meta"), x.to("meta"))
        assert traced_layout_differs(real, meta) == (tuple(meta.shape), meta.stride())


def test_values_off_their_traced_layout_train_and_evaluate_like_eager():
    torch.manual_seed(0)
    model = TransposedActivations()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules", options=OPTIONS)
    cgcompile.reset_stats()
    replays = []
    for step in range(STEPS):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        loss, want = compiled(x), reference(x)
        loss.backward()
        want.backward()
        assert torch.equal(loss, want), step
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
            p.grad = q.grad = None
        replays.append(sum(row["replays"] for row in cgcompile.stats()["partitions"]))
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(16, 4)
            assert torch.equal(compiled(x), reference(x)), step
    st = cgcompile.stats()
    assert st["eager_fallbacks"] == [], st["eager_fallbacks"]
    assert replays == [0, 0, 1, 2], replays  # one partition: warmup, capture, then a replay per step
    kinds = {g["label"].rsplit(" ", 1)[-1]: g["replays"] for g in st["graphs"]}
    assert kinds["forward"] > 1 and kinds["backward"] > 1 and kinds["inference"] > 1, kinds


def test_a_restrided_value_written_in_place_later_is_read_with_that_write():
    """A value restrided after its op and then written in place (the eager inner compiler's intermediate writes:
    `add_` into a `softplus_backward`): later readers see the write, on the first (checking) run and on every
    run of the rewritten graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from cgcompile.runtime.local.traced_strides import keep_traced_strides

    aten = torch.ops.aten

    def f(grad, x, y):
        g = aten.softplus_backward(grad.transpose(1, 2), x, 1, 20)  # real: transposed; traced (meta): contiguous
        g.add_(y)
        return g.view(-1) * 2  # viewable in the traced layout only

    grad, x, y = torch.randn(2, 8, 4), torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    gm = make_fx(f, tracing_mode="fake")(grad, x, y)
    assert aten.add_.Tensor in [n.target for n in gm.graph.nodes]
    run = keep_traced_strides(gm, lambda args: gm(*args))
    want = aten.softplus_backward(grad.transpose(1, 2), x, 1, 20).add(y).reshape(-1) * 2
    for _ in range(2):  # the checking run, then the rewritten graph
        torch.testing.assert_close(run([grad, x, y]), want, rtol=0, atol=0)

"""A partition's parameter set is known by an identity stable by construction (runtime/bank/key.py): a tensor that
only passes isinstance(x, nn.Parameter), made anew on every call (DTensor.to_local() of an FSDP2 parameter, as
torchtitan's experts call it), never starts a new set; and a partition whose sets never warm up says so in
stats()["eager_fallbacks"] instead of running "planned capture" uncaptured in silence."""


import torch

from cgcompile import reset_stats, stats
from cgcompile.runtime.bank.key import ParamSetIdentity
from cgcompile.runtime.tensors import registered_parameter
from tests.test_runtime_local import partition, runtime


def flagged(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor object that passes isinstance(x, nn.Parameter) without being one (the `_is_param` flag)."""
    t._is_param = True
    return t


def test_a_per_call_view_of_a_parameter_keeps_its_layer_and_the_graphs_replay():
    rt = runtime()
    layers = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]  # two layers served by one compiled partition
    p = partition(lambda x, w: (x * w).sin(), rt, static=[1])
    x = torch.randn(4)
    for _ in range(6):
        for w in layers:
            view = flagged(w.detach())  # a new object every call, on the parameter's storage
            assert isinstance(view, torch.nn.Parameter) and not registered_parameter(view)
            assert torch.equal(p(x, view), (x * w).sin())
    assert p.bank_counters().captures == 2 and stats()["eager_fallbacks"] == []  # one graph per layer, no new set per call
    assert [g.replays - 1 for g in rt.live_graphs()] == [4, 4]  # each run again after its capture call  # each run again after its capture call


def test_a_registered_parameter_is_the_identity_before_a_flagged_tensor():
    w = torch.nn.Parameter(torch.randn(3))
    identity = ParamSetIdentity(frozenset({0, 1}))
    args = (flagged(torch.randn(3)), w)
    identity.learn(args)
    assert identity.index == 1 and identity.by_object and identity.of(args) == id(w)


def test_a_warmup_that_never_ends_falls_back_with_its_reason():
    rt = runtime()
    w = torch.nn.Parameter(torch.randn(4))
    p = partition(lambda x, w: x * w, rt, static=[1])
    x = torch.randn(4)
    for _ in range(12):
        fresh = flagged((w * 1).detach())  # new memory on every call: no graph could ever replay
        assert torch.equal(p(x, fresh), x * fresh)
    (fallback,) = stats()["eager_fallbacks"]
    assert fallback["partition"] == "p"
    assert fallback["reason"].startswith("4 parameter sets came and went before any captured a graph")
    assert "argument 1 (Tensor)" in fallback["reason"]
    assert stats()["graphs_captured"] == 0 and p.broken is not None


def test_layers_that_come_and_go_after_capturing_do_not_fall_back():
    """A model rebuilt (new parameter objects) after its graphs were captured: old sets go, nothing falls back."""
    rt = runtime()
    p = partition(lambda x, w: x * w, rt, static=[1])
    x = torch.randn(4)
    for _ in range(8):
        w = torch.nn.Parameter(torch.randn(4))
        for _ in range(3):
            assert torch.equal(p(x, w), x * w)
        del w
    assert stats()["eager_fallbacks"] == [] and p.broken is None
    assert p.bank_counters().captures == 8


def _layers_with_per_call_views(steps: int = 8) -> dict:
    """Two layers served by one partition, called with fresh flagged views of their parameters (as torchtitan's
    experts pass `w.to_local()`), many short-lived objects made between calls so freed ids come back: what
    the partition captured and replayed."""
    reset_stats()
    rt = runtime()
    layers = [torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    p = partition(lambda x, w: (x * w).sin(), rt, static=[1])
    x = torch.ones(4)
    for _ in range(steps):
        for w in layers:
            litter = [torch.empty(4) for _ in range(7)]  # short-lived tensors: ids freed and reused
            assert torch.equal(p(x, flagged(w.detach())), (x * w).sin())
            del litter
    return {"captures": p.bank_counters().captures, "fallbacks": len(stats()["eager_fallbacks"]),
            "replays": sorted(g.replays for g in rt.live_graphs())}


def work(rank: int, world: int) -> dict:
    import torch.distributed as dist

    result = _layers_with_per_call_views()
    dist.barrier()
    return result


def test_every_rank_captures_the_same_graphs_for_per_call_views(tmp_path):
    """The parameter set's identity does not hang on which object ids CPython reuses: every rank captures and
    replays the same graphs (a rank that captured while another did not would hang on a graph's collective)."""
    from tests.spawn import run_ranks

    ranks = run_ranks(__file__, tmp_path, 2, 120, "per-call views")
    assert ranks[0] == ranks[1] == {"captures": 2, "fallbacks": 0, "replays": [7, 7]}


if __name__ == "__main__":
    from tests.spawn import serve

    serve(work, 60)

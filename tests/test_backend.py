"""The backend end to end on CPU: string resolution, errors through torch.compile, numerics vs eager."""

import copy
import os
import subprocess
import sys

import pytest
import torch

import cgcompile
from cgcompile.backend import record_plans
from tests.models import MODELS
from tests.parity import assert_step_matches_eager

CONFIGS = {
    "none": {"cuda_graph_impl": "none"},
    "local_modules": None,  # the model's recommended cuda_graph_modules
    "local_whole_layer": {"cuda_graph_impl": "local", "cuda_graph_modules": []},
}


def assert_matches_eager(spec, options, steps=2):
    model = spec.make(num_layers=2)
    reference = copy.deepcopy(model)
    (tokens,) = spec.example_inputs()
    compiled = torch.compile(model, backend="cudagraph_modules", options=options)
    with torch._dynamo.config.patch(**spec.dynamo_flags()), record_plans() as rec:
        for _ in range(steps):
            assert_step_matches_eager(spec, compiled, model, reference, tokens)
    return rec.graphs


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_and_all_gradients_match_eager(name, config):
    spec = MODELS[name]
    options = CONFIGS[config] or spec.options()
    graphs = assert_matches_eager(spec, options)
    assert graphs, "the backend was never called"
    if config == "none":
        assert all(not g.captured for g in graphs)
    else:
        assert any(g.captured for g in graphs), [str(p) for g in graphs for p in g.partitions]


def test_string_backend_resolves_through_the_entry_point_without_import():
    code = ("import torch\n"
            "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
            "x = torch.randn(2, 4)\n"
            "out = torch.compile(m, backend='cudagraph_modules', options={'cuda_graph_modules': []})(x)\n"
            "import sys\n"
            "assert torch.equal(out, m(x))\n"
            "print('cgcompile' in sys.modules, 'cudagraph_modules' in torch._dynamo.list_backends())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/..")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True"]  # loaded by torch through the entry point, not by us


def test_bad_options_fail_at_first_call_with_our_message():
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="cudagraph_modules",
                             options={"cuda_graph_impl": "locall"})
    with pytest.raises(Exception) as info:
        compiled(torch.randn(1, 2))
    text = str(info.value)
    assert "cuda_graph_impl" in text and "'locall'" in text and "did you mean 'local'" in text
    assert isinstance(info.value, cgcompile.ConfigError) or isinstance(info.value.__cause__, cgcompile.ConfigError) \
        or "ConfigError" in text


def test_inductor_modes_are_rejected_with_a_pointer_to_options():
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="cudagraph_modules", mode="reduce-overhead")
    with pytest.raises(Exception, match=r"mode='reduce-overhead' is not supported.*options="):
        compiled(torch.randn(1, 2))


def test_dynamo_config_is_not_flipped():
    before = dict(torch._dynamo.config.get_config_copy())
    spec = MODELS["dense_gpt"]
    model = spec.make()
    torch.compile(model, backend="cudagraph_modules")(*spec.example_inputs())
    cgcompile.explain(model, *spec.example_inputs())
    after = dict(torch._dynamo.config.get_config_copy())
    assert {k: v for k, v in after.items() if before.get(k) != v} == {}


def test_explain_rejects_bad_options_before_tracing():
    calls = []

    def fn(x):
        calls.append(1)
        return x + 1

    with pytest.raises(cgcompile.ConfigError, match="unknown option 'cuda_graph_modlues'"):
        cgcompile.explain(fn, torch.randn(2), options={"cuda_graph_modlues": ["attn"]})
    assert calls == []


def test_verify_reports_the_difference_per_captured_partition(caplog):
    spec = MODELS["dense_gpt"]
    model = spec.make()
    (tokens,) = spec.example_inputs()
    cgcompile.reset_stats()
    compiled = torch.compile(model, backend="cudagraph_modules", options=spec.options(driver="emulate", verify=5))
    with caplog.at_level("INFO", logger="cgcompile"):
        for _ in range(3 + 7):  # 3 warmup calls, then verified replays
            spec.loss(compiled, tokens).backward()
    table = cgcompile.stats()["verify_max_diff"]
    assert len(table) == 2 and all(v <= 1e-6 for v in table.values()), table  # one per layer partition
    lines = [r.getMessage() for r in caplog.records if "cgcompile verify" in r.getMessage()]
    assert len(lines) == 2 * 5  # verify starts after warmup and stops after 5 calls per partition
    assert cgcompile.stats()["steady_replays"] > 0


def test_graph_runs_unsplit_when_nothing_would_be_captured(monkeypatch):
    import cgcompile.backend as backend

    calls = []
    real_split = backend.split
    monkeypatch.setattr(backend, "split", lambda *a: calls.append(1) or real_split(*a))
    spec = MODELS["dense_gpt"]
    (tokens,) = spec.example_inputs()
    for driver, expected_splits in (("eager", 0), ("auto", 0), ("emulate", 1)):  # auto on CPU = eager
        torch._dynamo.reset()
        calls.clear()
        model = spec.make()
        compiled = torch.compile(model, backend="cudagraph_modules", options=spec.options(driver=driver))
        torch.testing.assert_close(compiled(tokens), model(tokens), rtol=0, atol=0)
        assert len(calls) == expected_splits, driver


def test_new_users_sequential_captures_one_partition_and_trains_like_eager():
    """The first try of docs/getting-started.md: an untagged nn.Sequential, whole-layer mode. Each child is its
    own 1-op "layer"; they must merge into one captured partition instead of three too-small eager ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 6))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"cuda_graph_impl": "local", "driver": "emulate"})
    cgcompile.reset_stats()
    for step in range(5):
        x = torch.randn(3, 6)
        out, expected = compiled(x), reference(x)
        torch.testing.assert_close(out, expected)
        out.sum().backward(), expected.sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    s = cgcompile.stats()
    assert s["graphs_captured"] == 2 and s["eager_fallbacks"] == []  # one partition: forward + backward

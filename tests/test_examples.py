"""Each example runs as a user would run it (a subprocess, tiny settings, CPU) and prints what it promises."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(*argv, timeout=180):
    # The CPU path even on a GPU machine; one OpenMP thread, since spinning threads on a busy small host can
    # slow a run down 30x.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def run_example(name, *args, timeout=180):
    return run_python(os.path.join(ROOT, "examples", name), *args, timeout=timeout)


@pytest.mark.parametrize("driver", ["auto", "emulate"])
def test_train_moe_learns_and_prints_plan(driver, tmp_path):
    html = tmp_path / "plan.html"
    out = run_example("train_moe.py", "--steps", "60", "--log-every", "20", "--driver", driver, "--html", str(html))
    assert "cgcompile plan: cuda_graph_impl=local" in out
    assert re.search(r"^\s*\d+\s+capture\s+attn\+moe_router\+moe_preprocess\s", out, re.M)
    assert re.search(r"dynamic_shape: torch\.nonzero at moe\.py:\d+", out)  # why the dispatch stays eager
    assert f"driver={driver}" in out
    losses = [float(x) for x in re.findall(r"^step\s+\d+/60\s+loss (\d+\.\d+)$", out, re.M)]
    assert len(losses) == 4  # steps 0, 20, 40 and the last one
    assert losses[-1] < 0.5 * losses[0], losses  # the synthetic task is learnable: the loss must fall
    assert html.read_text().startswith("<!DOCTYPE html>")


def test_tp_train_captures_dtensor_collectives_and_learns():
    """Two gloo ranks, TP with sequence parallel, emulate driver: the plan lists each redistribution inside a
    captured partition, the loss falls, and each captured graph replays with the collectives DTensor put in it."""
    out = run_example("tp_train.py", "--sequence-parallel", "--steps", "40", "--log-every", "20")
    assert "DTensor redistributions" in out
    assert re.search(r"^\s*1\s+capture\s+reduce_scatter over tp\s+Partial\(sum\) -> Shard\(1\)\s+layers\.0\.attn\.o", out, re.M)
    losses = [float(x) for x in re.findall(r"^step\s+\d+/40\s+loss (\d+\.\d+)$", out, re.M)]
    assert len(losses) == 3 and losses[-1] < 0.6 * losses[0], losses
    assert "re-captures 0, eager fallbacks 0" in out
    # 2 layers x forward/backward; the last forward gathers the sequence back, the first backward the gradient of
    # the first layer's sequence split
    graphs = re.findall(r"replayed (\d+)x; collectives inside: all_gather_into_tensor x[23], reduce_scatter_tensor x2$",
                        out, re.M)
    assert len(graphs) == 4 and all(int(n) >= 30 for n in graphs), out


@pytest.mark.parametrize("scope, captured", [("layer", 2), ("block", 1)])
def test_infer_gpt_scopes(scope, captured):
    out = run_example("infer_gpt.py", "--scope", scope, "--layers", "2", "--tokens", "6")
    assert f"inference, {scope} scope" in out
    assert re.search(rf"partitions, {captured} captured", out), out  # one graph per layer vs one for the block
    assert "greedy tokens identical to eager: True" in out
    rates = re.findall(r"^(eager|cgcompile):\s+(\d+\.\d+) tokens/s", out, re.M)
    assert [name for name, _ in rates] == ["eager", "cgcompile"] and all(float(r) > 0 for _, r in rates)


def test_megatron_flags_migrations():
    out = run_example("megatron_flags.py")
    blocks = out.strip().split("\n\n")
    by_input = {b.splitlines()[0]: b for b in blocks if b.startswith("input:")}
    full_iter = by_input["input:      {'cuda_graph_impl': 'local', 'cuda_graph_scope': ['full_iteration']}"]
    assert "FutureWarning: deprecated option: cuda_graph_scope=['full_iteration'] -> " \
           "cuda_graph_impl='full_iteration'" in full_iter
    assert "normalized: cuda_graph_impl='full_iteration', cuda_graph_modules=[]" in full_iter
    mixed = by_input["input:      {'cuda_graph_scope': ['attn', 'moe_router', 'moe_preprocess', "
                     "'full_iteration_inference']}"]
    assert "cuda_graph_modules=['attn', 'moe_router', 'moe_preprocess'], inference_cuda_graph_scope='block'" in mixed
    two = by_input["input:      {'enable_cuda_graph': True, 'cuda_graph_scope': 'attn,mlp'}"]
    assert two.count("FutureWarning") == 2 and two.count(" -> ") == 4  # two warnings, two recorded migrations
    # Megatron-Core 0.19.2's local impl pairs moe_router with moe_preprocess: recorded, with no FutureWarning
    router = by_input["input:      {'cuda_graph_scope': ['attn', 'moe_router']}"]
    assert router.count("FutureWarning") == 1
    assert "cuda_graph_modules=['attn', 'moe_router'] -> cuda_graph_modules=['attn', 'moe_router', " \
           "'moe_preprocess'] (the local impl captures" in router
    unset = by_input["input:      {'enable_cuda_graph': True, 'cuda_graph_impl': 'none'}"]  # 'none' = not set
    assert "normalized: cuda_graph_impl='local'" in unset
    assert sum("ConfigError: " in b for b in blocks) == 2
    assert out.rstrip().endswith("11 accepted, 2 rejected")


@pytest.mark.parametrize("args, captured", [((), False), (("--driver", "emulate", "--dynamic-padding", "buckets"), True)])
def test_demo_prints_the_plan_and_trains_like_eager(args, captured):
    """`make demo`, the README's main job: on a CPU it plans, trains like eager and says what a GPU would
    capture; with padding and the emulate driver the experts' partitions are captured and replayed."""
    out = run_python("-m", "cgcompile.demo", "--steps", "5", "--html", "", *args, timeout=240)
    assert "cgcompile plan: cuda_graph_impl=local" in out
    pairs = re.findall(r"^step \d+: loss (\d+\.\d+) \(eager (\d+\.\d+)\)$", out, re.M)
    assert len(pairs) == 5 and all(ours == eager for ours, eager in pairs), pairs
    graphs = int(re.search(r"graphs captured: (\d+)", out)[1])
    if captured:
        assert graphs > 0 and re.search(r"capture\s+moe\s+layers\.0\s+\d+\s+padded buckets: 4 producers", out)
    else:
        assert graphs == 0 and "--dynamic-padding buckets" in out


def test_hf_moe_train_matches_eager_and_captures():
    pytest.importorskip("transformers")
    out = run_example("hf_moe_train.py", "--steps", "4", "--bf16")
    assert re.findall(r"^step \d: .* equal (\w+)$", out, re.M) == ["True"] * 4, out
    assert re.search(r"^\s*\d+\s+capture\s+attn\+moe\S*\s+model\.layers\.1\s", out, re.M), out  # a whole layer
    captured = re.search(r"graphs captured (\d+), replays (\d+), eager fallbacks (\d+)", out)
    assert int(captured[1]) > 0 and int(captured[2]) > 0 and captured[3] == "0", out


@pytest.mark.parametrize("argv", [(), ("--capture-sizes", "1,2,4", "--batch", "3")])
def test_hf_generate_static_cache_decode_equals_eager(argv):
    pytest.importorskip("transformers")
    out = run_example("hf_generate.py", *argv)
    assert "greedy tokens identical to eager: True" in out, out
    captured = re.search(r"graphs captured (\d+), replays (\d+), eager fallbacks (\d+)", out)
    assert int(captured[1]) > 0 and int(captured[2]) > 0 and captured[3] == "0", out

"""The CPU benchmark scripts run end to end: bench_cpu's quick mode and the scale table (the GPU scripts:
test_benchmarks_gpu.py).

Numbers are not asserted (this is a shared CPU); the tables' shape, the goals and the failure paths are.
"""

import json
import re
import sys

from tests.bench_scripts import load_bench, run_script



def test_bench_cpu_judges_the_ratio_it_prints():
    within = load_bench("bench_cpu").within
    assert within(1.1004, 1.1)  # printed "1.10x <= 1.10x": PASS, as the row reads (a row at its goal read MISS on CI)
    assert not within(1.106, 1.1)  # printed "1.11x"
    assert within(0.05, 0.10) and not within(0.2, 0.10)


def test_bench_cpu_quick_table():
    out = run_script("bench_cpu.py", "--quick", "--emulate", timeout=420)  # table (e) adds 3 short MoE runs
    rows = [line for line in out.splitlines()
            if line.startswith("(") and not line.startswith(("(g)", "(h)", "(i)", "(j)"))]
    assert [r[:3] for r in rows] == ["(a)", "(a)", "(b)", "(b)", "(c)"]
    for row in rows:
        m = re.search(r"(\d+\.\d+)x\s+<= (\d+\.\d+)x\s+(PASS|MISS)$", row)
        assert m, row
        ratio, goal, verdict = float(m[1]), float(m[2]), m[3]
        assert verdict == ("PASS" if ratio <= goal else "MISS")
    assert "driver=auto" in rows[0] and "driver=emulate" in rows[1]
    assert "aot_eager" in rows[0] and "eager backend" in rows[2]
    padding = {line.split()[0]: line.split() for line in out.split("dynamic_padding (d)")[1].splitlines()[2:6]}
    assert list(padding) == ["eager", "off", "max", "buckets"]
    assert float(padding["max"][5]) == 0.0  # host syncs per step with dynamic_padding="max"
    assert float(padding["max"][1]) < float(padding["eager"][1]) / 4  # kernel ops outside graphs
    bank = {tuple(line.split()[:2]): line.split() for line in out.split("graph bank (e)")[1].splitlines()[2:6]}
    assert list(bank) == [("off", "8x64"), ("buckets", "8x64"), ("max", "8x64"), ("buckets", "3x32")]
    assert all(row[-1] == "PASS" for key, row in bank.items() if key[1] == "8x64"), bank  # bounded, kept graphs hit
    held, own = bank[("buckets", "3x32")][3], bank[("buckets", "3x32")][4]  # held at the last step; no arenas
    assert float(held.split("/")[1]) < float(own)  # bucket sizes that repeat share their outputs' memory
    replay = out.split("(g) host time per replay")[1].split("(g) reuse")[0].splitlines()[1:5]
    for row in replay:  # timings: informational on a shared CPU, but each verdict agrees with its printed ratio
        # (a cost over a bound, a difference of medians, comes out below 0 when the quick run's noise exceeds it)
        m = re.search(r": (-?\d+\.\d+)x, goal <= (\d+\.\d+)x  (PASS|MISS)$", row)
        assert m, row
        assert m[3] == ("PASS" if float(m[1]) <= float(m[2]) else "MISS"), row
    heading, *lean = out.split("(g) lean step")[1].splitlines()[:6]
    m = re.search(r"reference: a minimal backend copying the inputs in and cloning its outputs (\d+\.\d+) us, "
                  r"(\d+\.\d+)x$", heading)
    assert m and float(m[1]) > 0, heading  # what any copying, cloning CUDA-graph backend pays, printed beside the goals
    for row in lean[:2]:  # whole decode step vs Dynamo's floor, layer then block scope: verdicts agree with ratios
        m = re.search(r"^  (layer|block) scope: .*: (\d+\.\d+)x, goal <= (\d+\.\d+)x  (PASS|MISS)$", row)
        assert m, row
        assert m[4] == ("PASS" if float(m[2]) <= float(m[3]) else "MISS"), row
    m = re.search(r"^  block scope with the host path in Python .*: (\d+\.\d+) us, (\d+\.\d+)x the floor$", lean[2])
    assert m and float(m[1]) > 0, lean[2]  # what the compiled host path saves, in the same run
    m = re.search(r"^  layer scope's bound .*: (\d+\.\d+) us, (\d+\.\d+)x the floor; layer scope (\d+\.\d+)x its bound$",
                  lean[3])
    assert m and float(m[1]) > 0, lean[3]  # the glue's own cost, printed beside layer scope's goal
    assert "left out by --quick" in lean[4]
    kernels = out.split("(j) kernels per step")[1].split("\n\n")[0]
    counts = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(r"^    (\S+)\s+(\d+\.\d+) kernels/step "
                                                                    r"\(\s*(\d+\.\d+) outside graphs\)", kernels, re.M)}
    assert set(counts) == {"eager", "cg-eager"}, kernels
    assert counts["eager"][0] == counts["eager"][1] > 0  # no graph: every kernel launched one by one
    assert counts["cg-eager"][1] < counts["eager"][1] / 4, kernels  # block scope: the step replays one graph
    outside = kernels.split("cg-eager outside graphs: ")[1].splitlines()[0].split(", ")
    assert sorted(outside) == ["aten::_foreach_copy_ 1", "aten::copy_ 1"], kernels  # inputs in, the output out
    assert "(i) what the graphs hold: left out by --quick" in out
    reuse = out.split("(g) reuse")[1].splitlines()[1:7]
    assert len(reuse) == 6 and all(row.endswith("PASS") for row in reuse), reuse  # counts: deterministic
    if "HF MoE (f): skipped" not in out:  # transformers installed: its quick run is bf16 only
        hf = {line.split()[1]: line.split() for line in out.split("HF MoE (f)")[1].splitlines()[2:4]}
        assert list(hf) == ["eager", "captured"] and hf["eager"][0] == "bfloat16"
        assert float(hf["captured"][2]) < float(hf["eager"][2]) / 4  # kernel ops outside graphs
        assert float(hf["captured"][7]) > 0  # graph replays per step (after "<= 0.05x" and the syncs)


def test_scale_table_judges_each_ratio_and_bench_cpu_prints_it(monkeypatch, capsys):
    """Table (h): planning, capture and step at 48 vs 12 layers, each judged against 4.4x; the gc-off capture row
    is a diagnosis, never judged (the measurement itself takes minutes: benchmarks/scale_cost.py)."""
    scale = load_bench("scale_cost")

    def rows(plan, capture, step):
        return [{"plan": plan, "capture": capture, "step": step, "step_computing": 2 * step, "graphs": 2,
                 "gc_count": [1, 0, 0], "gc_seconds": 0.0}]

    found = {"gc on": {12: rows(1.0, 1.0, 1.0), 48: rows(3.8, 5.8, 4.4)},
             "gc pending": {12: rows(1.0, 1.0, 1.0), 48: rows(3.8, 6.5, 4.4)},
             "gc off": {12: rows(1.0, 1.0, 1.0), 48: rows(3.8, 4.0, 4.4)}}
    table = {what: (round(ratio, 2), verdict) for what, _, _, ratio, verdict in scale.table(found, 12, 48)}
    assert table == {"planning": (3.8, "PASS"), "capture": (5.8, "MISS"), "per-step host time": (4.4, "PASS"),
                     "capture, the compile's garbage not collected first (diagnosis)": (6.5, "-"),
                     "capture with gc.disable() (diagnosis)": (4.0, "-"),
                     "step, replays computing (diagnosis)": (4.4, "-")}
    bench_cpu = load_bench("bench_cpu")
    monkeypatch.setattr(scale, "run", lambda small, large, repeats: found)
    monkeypatch.setitem(sys.modules, "scale_cost", scale)
    bench_cpu.print_scale(False, 3)
    out = capsys.readouterr().out
    assert "(h) scale at depth: 48 vs 12 layers, 64 experts top-8" in out
    assert re.search(r"  capture: 1\.00 s vs 5\.80 s: 5\.80x <= 4\.40x  MISS", out), out
    assert re.search(r"  capture with gc\.disable\(\) \(diagnosis\): 1\.00 s vs 4\.00 s: 4\.00x  -$", out, re.M), out
    bench_cpu.print_scale(True, 1)
    assert "left out by --quick" in capsys.readouterr().out


def test_scale_measure_times_what_it_names_on_a_real_compile():
    """scale_cost.measure on a real 2-layer compile: the functions it wraps are the ones the backend calls (it
    once wrapped a name the backend no longer had and failed before measuring), every graph is captured once and
    replayed in the steady steps."""
    scale = load_bench("scale_cost")
    found = scale.measure(2, steps=2)
    assert found["plan"] > 0 and found["capture"] > 0 and 0 < found["step"] < found["step_computing"], found
    assert found["graphs"] == 4 and found["replays"] >= 4 * 2, found  # 2 layers x (forward + backward)


def test_step_instructions_counts_steps_that_take_the_short_path():
    """benchmarks/step_instructions.py counts each candidate's decode steps under callgrind; what it counts for
    cgcompile must be steady replays (the short path), one per partition per step, or the count measures another
    path. Run here without valgrind: the same candidates and steps, nothing counted."""
    out = run_script("step_instructions.py", "--child", "--no-valgrind", "--layers", "2", "--steps", "3",
                     "--warmup", "30")
    rows = {row["name"]: row["steady_per_step"] for row in map(json.loads, out.splitlines())}
    assert list(rows) == ["floor", "minimal", "layer", "layer bound", "block"]
    assert rows["layer"] == 2.0 and rows["block"] == 1.0  # 2 layers: one graph each; block scope: one graph
    assert rows["floor"] == rows["minimal"] == rows["layer bound"] == 0.0


def test_the_real_loop_per_call_rows_stand_ins_run_the_plan_and_decode_like_eager():
    """Table (g)'s per-call rows share a real loop's step time out over the partitions cgcompile would capture:
    the stand-ins must be exactly those partitions (counted one per captured partition of the plan: 2 layers in
    layer scope, one graph in block scope), and the minimal wrapper standing in for them must run the real step
    (the same tokens and cache as eager), or the row would time a shortcut."""
    import torch

    replay_cost = load_bench("replay_cost")
    from tests.models import kv_gpt

    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    eager = kv_gpt.build(num_layers=2).eval()
    expected = kv_gpt.generate(kv_gpt.DecodeStep(eager), eager, prompt, 6)
    for scope, partitions in (("layer", 2), ("block", 1)):
        torch._dynamo.reset()
        model = kv_gpt.build(num_layers=2).eval()
        held = {id(t) for t in (*model.parameters(), *model.buffers())}
        options = {"cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": scope, "driver": "emulate"}
        tally = replay_cost.StandIns()
        step = torch.compile(kv_gpt.DecodeStep(model), backend=replay_cost.minimal_partitions(options, held, tally))
        assert torch.equal(kv_gpt.generate(step, model, prompt, 6), expected), scope
        assert torch.equal(model.layers[1].attn.k_cache, eager.layers[1].attn.k_cache), scope
        assert tally.made == partitions, (scope, tally.made)

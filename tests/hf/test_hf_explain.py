"""explain() on transformers 5's eager experts loop: Dynamo breaks at the loop over `nonzero()`, and the plan
says so at the HF line with the fix a transformers user has (experts_implementation="grouped_mm"; the hint
is worded for transformers' code, cgcompile/code_source.py)."""

import os

import cgcompile
from tests.hf.families import build, tokens, transformers


def test_eager_experts_loop_break_names_its_line_and_the_fix():
    model = build("mixtral", experts_implementation="eager")
    ids = tokens(0)
    plan = cgcompile.explain(model, input_ids=ids, labels=ids, options={"driver": "emulate"})
    (brk,) = plan.graph_breaks
    source = os.path.join(os.path.dirname(transformers.__file__), "models", "mixtral", "modeling_mixtral.py")
    path, _, line = brk.location.rpartition(":")
    assert path == source and "nonzero()" in open(source).read().splitlines()[int(line) - 1]
    assert "experts_implementation='grouped_mm'" in brk.hint and "dynamic_padding" in brk.hint
    assert brk.to_json()["hint"] == brk.hint
    text = str(plan)
    assert "fix: transformers 5's eager experts loop" in text and " at ?" not in text
    # the plan still runs: every graph of the broken frame captured or eager with a reason, none unexplained
    assert all(p.captured or p.reasons for graph in plan.graphs for p in graph.partitions)

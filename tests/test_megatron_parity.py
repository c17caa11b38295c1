"""Megatron-Core parity: the same CUDA-graph options give the same config as Megatron-Core 0.19.2.

The cases (tests/megatron_cases.py) with Megatron-Core's results recorded by tests/megatron_oracle.py
(tests/data/megatron_core_0_19_2.json) are replayed through ``CudaGraphConfig.from_options``: each must agree
(accept/reject, normalized impl, module set, inference scope, whether it warns) or be a documented
difference (tests/megatron_differences.py, the table in docs/guides/megatron.md). The live variant runs the same cases through
an installed ``megatron.core`` (skipped without it; ``make megatron-parity`` sets one up).
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings

import pytest

from cgcompile.config import CudaGraphConfig
from cgcompile.errors import ConfigError
from tests.megatron_cases import cases, decode, stand_in_enums, summarize, summary_of_record
from tests.megatron_differences import DIFFERENCES, differences_table, documented_cases
from tests.megatron_oracle import data_path

VERSION = "0.19.2"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_record() -> dict:
    with open(data_path(VERSION)) as f:
        return json.load(f)


def cgcompile_result(options: dict) -> tuple[dict, CudaGraphConfig | None]:
    """One case through from_options, summarized like a Megatron record (and the config, when accepted)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = CudaGraphConfig.from_options(options)
        except ConfigError:
            return summarize(False), None
    modules = [str(m) for m in config.cuda_graph_modules]
    return summarize(True, config.cuda_graph_impl.value, modules, config.inference_cuda_graph_scope.value,
                     bool(caught)), config


def compare(recorded_cases: list[dict], enum_classes) -> dict[str, list[str]]:
    """Case ids by outcome: agree, documented (differs, listed in DIFFERENCES), undocumented, stale (listed but
    agrees)."""
    documented = documented_cases()
    out: dict[str, list[str]] = {"agree": [], "documented": [], "undocumented": [], "stale": []}
    for case in recorded_cases:
        options = {name: decode(value, enum_classes) for name, value in case["options"].items()}
        ours, _ = cgcompile_result(options)
        theirs = summary_of_record(case, case["megatron"])
        if ours == theirs:
            out["stale" if case["id"] in documented else "agree"].append(case["id"])
        else:
            out["documented" if case["id"] in documented else "undocumented"].append(
                case["id"] if case["id"] in documented else f"{case['id']}: Megatron {theirs}, cgcompile {ours}")
    return out


def test_record_names_its_version_and_covers_every_case():
    record = load_record()
    assert record["megatron_core"] == VERSION and "tests/megatron_oracle.py" in record["produced_by"]
    assert [c["id"] for c in record["cases"]] == [c["id"] for c in cases()]
    assert [c["options"] for c in record["cases"]] == [c["options"] for c in cases()]
    assert all(c["megatron"]["accepted"] in (True, False) for c in record["cases"])


def test_every_case_agrees_with_megatron_or_is_documented():
    record = load_record()
    result = compare(record["cases"], stand_in_enums())
    assert result["undocumented"] == [] and result["stale"] == []
    assert len(result["agree"]) + len(result["documented"]) == len(record["cases"])
    assert set(documented_cases()) <= {c["id"] for c in record["cases"]}  # no difference names a missing case


def test_every_megatron_warning_is_a_recorded_migration_shown_in_the_plan():
    """Where Megatron-Core warns about a deprecated spelling, cgcompile records the rewrite on the config, and the
    plan header shows it."""
    from cgcompile.diagnostics import format_plan
    from cgcompile.explain import Plan

    enum_classes = stand_in_enums()
    checked = 0
    for case in load_record()["cases"]:
        theirs = summary_of_record(case, case["megatron"])
        if not (theirs["accepted"] and theirs["warned"]) or case["id"] in documented_cases():
            continue
        _, config = cgcompile_result({k: decode(v, enum_classes) for k, v in case["options"].items()})
        assert any(m.deprecated for m in config.migrations), case["id"]
        header = format_plan(Plan(config)).splitlines()[1]
        assert header == f"options rewritten: {'; '.join(map(str, config.migrations))}", case["id"]
        checked += 1
    assert checked >= 40


def test_docs_table_is_the_documented_list():
    with open(os.path.join(ROOT, "docs", "guides", "megatron.md")) as f:
        page = f.read()
    assert differences_table() in page
    total = sum(len(d["cases"]) for d in DIFFERENCES)
    assert f"{len(cases())} option sets" in page and f"{total} are documented differences" in page


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed "
                    "(make megatron-parity runs this under a Python 3.12 venv with megatron-core==0.19.2)")
def test_live_megatron_core_agrees(capsys):
    import megatron.core

    from tests.megatron_oracle import megatron_enums, megatron_result

    # a venv inside a git checkout gets that checkout's commit appended ("0.19.2+ef39f92", its package_info.py)
    if megatron.core.__version__.split("+")[0] != VERSION:
        pytest.skip(f"megatron-core {megatron.core.__version__} installed; the documented differences are for "
                    f"{VERSION}")
    enum_classes = megatron_enums()
    live = []
    for case in cases():
        options = {name: decode(value, enum_classes) for name, value in case["options"].items()}
        live.append({**case, "megatron": megatron_result(options)})
    # the recorded file is what this Megatron-Core does (so the normal suite replays the truth)
    assert [c["megatron"] for c in live] == [c["megatron"] for c in load_record()["cases"]]
    result = compare(live, enum_classes)  # Megatron's own enum members as values
    with capsys.disabled():
        print(f"\nmegatron-core {VERSION} live: {len(live)} cases, {len(result['agree'])} agree, "
              f"{len(result['documented'])} documented differences, {len(result['undocumented'])} undocumented")
    assert result["undocumented"] == [] and result["stale"] == []


def test_plan_shows_the_rewrites_and_the_router_pair_needs_only_one_tag():
    """Traced: the plan header shows the rewrites; with the local impl a model tagging only moe_router is not an
    error for the moe_preprocess the pairing added (either tag of the pair matches), and under impl 'none' the
    selection is kept in the plan."""
    import torch
    import torch.nn as nn

    import cgcompile

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = cgcompile.tag("attn")(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
            self.router = cgcompile.tag("moe_router")(nn.Sequential(nn.Linear(8, 4), nn.Softmax(-1)))
            self.out = nn.Linear(4, 8)

        def forward(self, x):
            x = x + self.attn(x)
            return x + self.out(self.router(x))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = cgcompile.explain(Block(), torch.randn(4, 8), options={"cuda_graph_impl": "local",
                                                                         "cuda_graph_modules": ["attn", "moe_router"]})
        none = cgcompile.explain(Block(), torch.randn(4, 8), options={"cuda_graph_impl": "none",
                                                                        "cuda_graph_scope": ["attn", "moe_router"]})
    header, rewritten = str(local).splitlines()[:2]
    assert "cuda_graph_modules=[attn, moe_router, moe_preprocess]" in header
    assert rewritten.startswith("options rewritten: cuda_graph_modules=['attn', 'moe_router'] -> "
                                "cuda_graph_modules=['attn', 'moe_router', 'moe_preprocess']")
    assert {"attn", "moe_router"} <= {tag for p in local.graphs[0].partitions if p.captured for tag in p.tags}
    header, rewritten = str(none).splitlines()[:2]
    assert "cuda_graph_impl=none, cuda_graph_modules=[attn, moe_router]" in header
    assert rewritten == ("options rewritten: cuda_graph_scope=['attn', 'moe_router'] -> "
                         "cuda_graph_modules=['attn', 'moe_router']")
    with pytest.raises(ConfigError, match="selects 'moe_preprocess'"):  # one tag of the pair is still needed
        cgcompile.explain(Block(), torch.randn(4, 8), options={"cuda_graph_impl": "transformer_engine",
                                                                 "cuda_graph_modules": ["attn", "moe_router",
                                                                                        "moe_preprocess"]})

"""The HTML plan shows every partition and every reason of a real plan, escapes user text, and sizes by op count.

Parsed with html.parser (not regexes on raw text), so attribute escaping is undone exactly as a browser would.
"""

from html.parser import HTMLParser

import pytest
import torch

import cgcompile
from cgcompile.explain import Plan
from cgcompile.plan import CAPTURE, EAGER, GraphBreak, GraphPlan, Partition
from cgcompile.reasons import Finding, Reason
from tests.models import MODELS


class _Page(HTMLParser):
    """Collects partition divs (attributes + text), graph-break items, and all visible text."""

    def __init__(self):
        super().__init__()
        self.partitions = []
        self.breaks = []
        self.text = []
        self.tags = []
        self._open = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        classes = (attrs.get("class") or "").split()
        if tag == "div" and "partition" in classes:
            self._open = dict(attrs, classes=classes, label="")
            self.partitions.append(self._open)
        elif tag == "li":
            self.breaks.append(attrs.get("title"))

    def handle_endtag(self, tag):
        if tag == "div":
            self._open = None

    def handle_data(self, data):
        self.text.append(data)
        if self._open is not None:
            self._open["label"] += data


def parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    return page


def flex_grow(part: dict) -> int:
    style = dict(item.split(":", 1) for item in part["style"].split(";") if ":" in item)
    return int(style["flex-grow"].strip())


@pytest.fixture(scope="module")
def moe_plan():
    spec = MODELS["moe_mask"]
    model = spec.make(num_layers=2)
    (tokens,) = spec.example_inputs()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        return cgcompile.explain(model, tokens, options=spec.options())


def test_every_partition_and_reason_is_drawn(moe_plan, tmp_path):
    path = tmp_path / "plan.html"
    text = moe_plan.to_html(path)
    assert path.read_text(encoding="utf-8") == text
    page = parse(text)
    expected = [p for g in moe_plan.graphs for p in g.partitions]
    kinds = {p.kind for p in expected}
    assert kinds == {CAPTURE, EAGER}, "the tiny MoE plan should have both kinds"
    assert len(page.partitions) == len(expected)
    n_reasons = 0
    for drawn, part in zip(page.partitions, expected):
        assert drawn["data-id"] == str(part.id)
        assert part.kind in drawn["classes"] and drawn["data-kind"] == part.kind
        title = drawn["title"]
        assert title.startswith(f"partition {part.id}: {part.kind}\n")
        assert f"ops: {part.num_ops}" in title.splitlines()
        assert f"module: {part.module or '-'}" in title.splitlines()
        for tag in part.tags:
            assert tag in title
        for reason in part.reasons:
            n_reasons += 1
            # Each reason is one line of the hover text: category, op, full file:line, and the hint.
            assert any(l.strip().startswith(f"{reason.category}: {reason.op} at {reason.location}")
                       and (not reason.hint or l.endswith(f"hint: {reason.hint}"))
                       for l in title.splitlines()), reason
        if part.kind == EAGER:
            assert part.reasons, "every eager partition carries at least one reason"
    assert n_reasons > 0
    # The nonzero that makes the dispatch data-dependent is named with its file:line in the hover text.
    assert any("torch.nonzero at" in p["title"] and "moe.py:" in p["title"] for p in page.partitions)
    assert "cuda_graph_impl=local" in "".join(page.text)


def test_widths_follow_op_counts(moe_plan):
    page = parse(moe_plan.to_html())
    parts = [p for g in moe_plan.graphs for p in g.partitions]
    grows = [flex_grow(d) for d in page.partitions]
    assert grows == [p.num_ops for p in parts]
    # flex-grow with a zero basis: widths proportional to op counts (which differ in this plan).
    assert len(set(grows)) > 1
    assert "min-width: 6px" in moe_plan.to_html()  # one-op islands stay visible


def _hostile_plan() -> Plan:
    evil = '<script>alert("x")</script>'
    reason = Finding(Reason.HOST_SYNC, "Tensor.item", 'a<b>&"c".py:7', "layers.0.<m>", hint="use & not <and>",
                     detail="reads 'value' > 0")
    parts = [Partition(0, CAPTURE, ("attn&mlp",), evil, 10, (), ("a",)),
             Partition(1, EAGER, (), "layers.0.<m>", 1, (reason,), ("b",)),
             Partition(2, CAPTURE, ("x",), None, 30, (), ("c",))]
    plan = Plan(cgcompile.CudaGraphConfig.from_options({"cuda_graph_modules": ["attn"]}),
                [GraphPlan(0, parts, "layer", "cpu", True)],
                [GraphBreak("Tensor.tolist() <data-dependent>\nsecond line", "m<o>e.py:3")])
    return plan


def test_user_text_is_escaped():
    text = _hostile_plan().to_html()
    page = parse(text)
    assert "script" not in page.tags and "m" not in page.tags and "and" not in page.tags
    assert "<script>" not in text and "<and>" not in text
    first, second, third = page.partitions
    assert '<script>alert("x")</script>' in first["title"]  # round-trips exactly once parsed
    assert "attn&mlp" in first["title"] and "attn&mlp" in first["label"]
    assert 'host_sync: Tensor.item at a<b>&"c".py:7' in second["title"]
    assert "hint: use & not <and>" in second["title"]
    assert page.breaks == ["Tensor.tolist() <data-dependent>\nsecond line"]
    visible = "".join(page.text)
    assert "m<o>e.py:3: Tensor.tolist() <data-dependent>" in visible
    assert [flex_grow(d) for d in page.partitions] == [10, 1, 30]


def test_graph_breaks_and_empty_plan():
    plan = Plan(cgcompile.CudaGraphConfig.from_options({}))
    page = parse(plan.to_html())
    assert page.partitions == [] and page.breaks == []
    assert "no graphs were compiled" in "".join(page.text)

"""cgcompile.report(path): the run as one static HTML page; parsed here (html.parser) and checked to show the
numbers stats() shows, for a training run (dense_gpt) and a decode run (kv_gpt); opened in a headless browser
only where one is installed."""

import shutil
import subprocess
from html.parser import HTMLParser

import pytest

import cgcompile
from tests import graph_window
from tests.test_benefit import DECODE, OPTIONS, SLOW_SUBMOD_2, decode, timer, train  # noqa: F401 (fixture)

NUMBERS = ("sizes", "calls", "replays", "reuse", "graph_bytes", "eager_ms", "replay_ms", "saving_ms",
           "saving_per_step_ms")


class ReportParser(HTMLParser):
    """Rows by data-partition ({column: text}), totals by data-total, and every external reference."""

    def __init__(self):
        super().__init__()
        self.rows, self.totals, self.external = {}, {}, []
        self._row = self._col = self._total = None
        self._text = ""

    @staticmethod
    def rows_of(text):
        page = ReportParser()
        page.feed(text)
        return page.rows

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("src", "href"):
            if attrs.get(key):
                self.external.append(attrs[key])
        if tag == "tr" and "data-partition" in attrs:
            self._row = self.rows.setdefault(attrs["data-partition"], {"status": attrs.get("class")})
        if tag == "td" and self._row is not None:
            self._col, self._text = attrs["data-col"], ""
        if tag == "span" and "data-total" in attrs:
            self._total, self._text = attrs["data-total"], ""

    def handle_data(self, data):
        if self._col is not None or self._total is not None:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "td" and self._col is not None:
            self._row[self._col], self._col = self._text, None
        elif tag == "tr":
            self._row = None
        elif tag == "span" and self._total is not None:
            self.totals.setdefault(self._total, []).append(self._text)
            self._total = None


def parsed(path):
    page = ReportParser()
    page.feed(path.read_text(encoding="utf-8"))
    assert page.external == []  # no script, stylesheet or image to fetch: opens offline
    return page


def shown(value):
    return "-" if value is None else str(value)


def assert_matches_stats(page, st):
    assert {row["partition"] for row in st["partitions"]} <= set(page.rows)
    for row in st["partitions"]:
        got = page.rows[row["partition"]]
        assert {k: got[k] for k in NUMBERS} == {k: shown(row[k]) for k in NUMBERS}, row["partition"]
        assert got["status"] == ("eager" if row["fallback"] else "captured")
        assert got["why"] == shown(row["fallback"] or None)
    assert page.totals["graph_bytes"][-1] == str(st["graph_bytes"])
    assert page.totals["graphs_captured"] == [str(st["graphs_captured"])]
    assert page.totals["steady_replays"] == [str(st["steady_replays"])]
    assert sum(int(v) for v in page.totals["graph_bytes"][:-1]) == st["graph_bytes"]  # per frame, then all


def test_training_report_shows_what_stats_shows(timer, tmp_path):
    graph_window.fresh()  # runtimes earlier tests left in reference cycles go now, not at a later collection
    timer(SLOW_SUBMOD_2)
    train(dict(OPTIONS, measure_benefit="on"))
    path = tmp_path / "run.html"
    cgcompile.report(path)
    st = cgcompile.stats()
    page = parsed(path)
    assert_matches_stats(page, st)
    slow = next(r for name, r in page.rows.items() if name.endswith("submod_2"))
    assert slow["status"] == "eager" and slow["why"].startswith("not_profitable") and slow["saving_ms"] == "-2.0"
    fast = next(r for name, r in page.rows.items() if name.endswith("submod_1"))
    assert fast["status"] == "captured" and fast["kind"] == "training" and fast["graphs"] == "2"
    islands = [r for r in page.rows.values() if r["kind"] == "eager island"]
    assert islands and all(r["why"].startswith("untagged") for r in islands)


def test_decode_report_shows_what_stats_shows(tmp_path):
    before = set(ReportParser.rows_of(cgcompile.report()))  # runtimes earlier tests left alive are shown too
    decode(dict(DECODE))
    path = tmp_path / "decode.html"
    cgcompile.report(path)
    page = parsed(path)
    assert_matches_stats(page, cgcompile.stats())
    (row,) = [row for name, row in page.rows.items() if name not in before]
    assert row["kind"] == "inference" and row["status"] == "captured" and row["eager_ms"] == "-"


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "firefox")


def test_report_renders_in_a_headless_browser(tmp_path):
    browser = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if browser is None:
        pytest.skip(f"no headless browser installed (looked for {', '.join(BROWSERS)}); the page is checked by "
                    f"parsing only")
    decode(dict(DECODE))
    path = tmp_path / "decode.html"
    cgcompile.report(path)
    shot = tmp_path / "shot.png"
    args = ([browser, "--headless", "--screenshot", str(shot), path.as_uri()] if "firefox" in browser else
            [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}", path.as_uri()])
    subprocess.run(args, check=True, timeout=120, capture_output=True)
    assert shot.stat().st_size > 1000

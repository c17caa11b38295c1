"""The docs site is right: it builds strictly (every warning and every unresolved link fails), every public name
has an API entry, every Python snippet runs on the CPU (or says why it needs a GPU), pasted outputs match what
the snippets print, the option table and the troubleshooting page cover what the code defines, and README stays
a short front page whose links resolve. Snippet conventions: tests/doc_snippets.py."""

import os
import re
import subprocess
import sys

import pytest

import cgcompile
from cgcompile.reasons import Reason
from tests.doc_snippets import (DOCS, REPO, check_printed, gpu_only_reason, page_name, pages,
                                python_snippets, run_page)

# Pages whose snippets another test runs, with assertions of its own on what they did.
OWN_TEST = {"docs/guides/huggingface.md": "tests/hf/test_hf_trainer.py"}
RUNNABLE = [page_name(p) for p in pages() if page_name(p) not in OWN_TEST
            and any(gpu_only_reason(f) is None for f in python_snippets(p))]


def load_hook():
    import importlib.util
    spec = importlib.util.spec_from_file_location("options_table", DOCS / "_hooks" / "options_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_strictly_with_every_public_name_in_the_reference(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=REPO, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = (site / "reference" / "index.html").read_text()
    def documented(name):  # under its public name, or where it is defined when a module shares the name
        defined_in = getattr(getattr(cgcompile, name), "__module__", "cgcompile")
        return any(f'id="{where}.{name}"' in reference for where in ("cgcompile", defined_in))

    assert [name for name in cgcompile.__all__ if not documented(name)] == []
    options = (site / "guides" / "tagging-and-options" / "index.html").read_text()
    assert "<code>max_graphs_per_partition</code>" in options and "generated: option table" not in options


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_snippets_run_on_the_cpu_and_print_what_the_page_shows(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, printed = run_page(REPO / page)
    check_printed(REPO / page, printed)


def test_pages_with_their_own_test_name_it():
    for page, test in OWN_TEST.items():
        assert page in (REPO / test).read_text(), (page, test)


def test_every_python_fence_is_seen_by_the_runner():
    """A ```python fence the parser does not see as one (indented inside an admonition, say) would never run."""
    for page in pages():
        raw = len(re.findall(r"^\s*```\s*(python|py)\b", page.read_text(), re.M))
        assert raw == len(python_snippets(page)), page_name(page)


def test_gpu_only_markers_give_a_reason():
    marked = [(page_name(p), gpu_only_reason(f)) for p in pages() for f in python_snippets(p) if gpu_only_reason(f)]
    assert marked and all(len(reason) > 10 for _, reason in marked), marked


def test_option_table_has_one_row_per_config_field():
    import dataclasses
    hook = load_hook()
    table = hook.option_table()
    fields = [f.name for f in dataclasses.fields(cgcompile.CudaGraphConfig) if f.name != "migrations"]
    rows = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert rows == fields
    assert "| `max_graphs_per_partition` | `8` |" in table and "| `driver` | `auto` |" in table
    assert hook.MARKER in (DOCS / "guides" / "tagging-and-options.md").read_text()


def test_stats_table_lists_every_key_stats_returns():
    page = (DOCS / "plan.md").read_text()
    section = page[page.index("## `cgcompile.stats()`"):]
    assert set(re.findall(r"^\| `(\w+)` \|", section, re.M)) == set(cgcompile.stats())


def test_troubleshooting_explains_every_reason_category_and_no_other():
    categories = {reason.value for reason in Reason}
    assert {"host_sync", "dynamic_shape", "not_paddable", "fsdp_resharded_params"} <= categories, categories
    page = (DOCS / "troubleshooting.md").read_text()
    plan_section = page[page.index("## Plan reasons"):page.index("## At run time")]
    documented = set(re.findall(r"^### `(\w+)`", plan_section, re.M))
    assert documented == categories


def test_readme_is_a_short_front_page_whose_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if not re.match(r"\w+://", link):
            assert (REPO / link).exists(), link

"""The Python snippets of the docs (docs/**/*.md and README.md), found with markdown-it-py, and how they run.

Conventions a page follows (tests/test_docs.py enforces them):
- every ```python fence runs on the CPU; a page's fences run in order in one namespace (a later one may use what
  an earlier one defined), in a temporary working directory;
- `<!-- gpu-only: why -->` on the line before a fence skips it; the reason is required;
- `<!-- printed -->` on the line before a ```text fence: that block must appear in what the page's snippets
  print, so a pasted output cannot go stale.
Snippets are compiled with the page as their file name and their real line numbers, so a plan printed by a
snippet cites `page.md:<line>` of the page itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import pathlib
import re
import sys
import types
import warnings
from typing import Any, Dict, List, Optional, Tuple

from markdown_it import MarkdownIt

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PYTHON = {"python", "py"}
GPU_ONLY = re.compile(r"<!--\s*gpu-only:(.*?)-->", re.S)
PRINTED = re.compile(r"<!--\s*printed\s*-->")
SNIPPET_MODULE = "cgcompile_docs_snippet"


@dataclasses.dataclass
class Fence:
    language: str
    line: int  # 1-based line of the fence's first code line
    code: str
    marker: str  # the HTML comment just before the fence, or ""


def pages() -> List[pathlib.Path]:
    """Every markdown page of the site, and README.md."""
    return sorted(DOCS.rglob("*.md")) + [REPO / "README.md"]


def page_name(page: pathlib.Path) -> str:
    return page.relative_to(REPO).as_posix()


def fences(page: pathlib.Path) -> List[Fence]:
    found: List[Fence] = []
    previous = None
    for token in MarkdownIt("commonmark").parse(page.read_text()):
        if token.type == "fence":
            marker = previous.content.strip() if previous is not None and previous.type == "html_block" else ""
            found.append(Fence(token.info.split()[0] if token.info else "", token.map[0] + 2, token.content, marker))
        previous = token
    return found


def gpu_only_reason(fence: Fence) -> Optional[str]:
    """The reason a fence does not run on the CPU, or None when it runs; a marker without a reason raises."""
    match = GPU_ONLY.fullmatch(fence.marker)
    if match is None:
        return None
    reason = match.group(1).strip()
    if not reason:
        raise ValueError(f"line {fence.line}: a gpu-only snippet must say why it cannot run on the CPU")
    return reason


def python_snippets(page: pathlib.Path) -> List[Fence]:
    return [f for f in fences(page) if f.language in PYTHON]


def printed_blocks(page: pathlib.Path) -> List[Fence]:
    return [f for f in fences(page) if f.language == "text" and PRINTED.fullmatch(f.marker)]


@contextlib.contextmanager
def _isolated():
    """Dynamo's config, logging and warning filters as they were before the page ran."""
    import torch
    dynamo_config = torch._dynamo.config.get_config_copy()
    root = logging.getLogger()
    ours = logging.getLogger("cgcompile")
    saved = (root.level, list(root.handlers), ours.level)
    try:
        with warnings.catch_warnings():
            yield
    finally:
        now = torch._dynamo.config.get_config_copy()
        for name, value in dynamo_config.items():  # only what changed: touching a deprecated key warns
            if now[name] != value:
                setattr(torch._dynamo.config, name, value)
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        ours.setLevel(saved[2])


def run_page(page: pathlib.Path) -> Tuple[Dict[str, Any], str]:
    """Run the page's CPU snippets in order in one namespace; (namespace, what they printed)."""
    import cgcompile
    cgcompile.reset_stats()
    # a real module: Dynamo imports a traced class's __module__ by name
    module = types.ModuleType(SNIPPET_MODULE)
    out = io.StringIO()
    sys.modules[SNIPPET_MODULE] = module
    try:
        with _isolated(), contextlib.redirect_stdout(out):
            for fence in python_snippets(page):
                if gpu_only_reason(fence) is not None:
                    continue
                code = compile("\n" * (fence.line - 1) + fence.code, page.name, "exec")
                exec(code, module.__dict__)  # noqa: S102 - the docs' own snippets
    finally:
        del sys.modules[SNIPPET_MODULE]
    return module.__dict__, out.getvalue()


def check_printed(page: pathlib.Path, printed: str) -> None:
    """Every `<!-- printed -->` text block of the page appears in its snippets' output."""
    lines = [line.rstrip() for line in printed.splitlines()]
    text = "\n".join(lines)
    for block in printed_blocks(page):
        expected = "\n".join(line.rstrip() for line in block.code.rstrip("\n").splitlines())
        assert expected in text, f"{page_name(page)}:{block.line}: printed block not in the output:\n{printed}"

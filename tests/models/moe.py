"""The tiny MoE test model: the demo's model (cgcompile/examples/moe.py, shipped with the package) plus the
source markers tests use to find the dispatch lines a plan should cite."""

from __future__ import annotations

import linecache
import re

from cgcompile.examples import moe as demo_model
from cgcompile.examples.moe import (D_MODEL, DISPATCH_STYLES, N_HEADS, NUM_EXPERTS, SORT_COUNTS, TOP_K, VOCAB,  # noqa: F401
                                  CUDA_GRAPH_MODULES, Block,
                                  Expert, MoE, MoEPreprocess, MoETransformer, RMSNorm, Router, SelfAttention,
                                  build, example_inputs, loss)

# The lines that make the dispatch data-dependent (what a plan should name as the cause of the eager island),
# per style; the other marked lines (gather, split, combine) only consume those results.
ORIGIN_KINDS = {"mask": ("nonzero",), "sort": ("bincount", "tolist")}

# ---- source markers -------------------------------------------------------------------------------------

SOURCE_FILE = demo_model.__file__
_MARKER = re.compile(r"\S.*#\s*DISPATCH\((?P<style>\w+)\):\s*(?P<kind>\w+)\s*$")


def dispatch_sites(dispatch: str) -> dict[str, list[int]]:
    """{op kind: [1-based line numbers in SOURCE_FILE]} for the marked dispatch lines of one style."""
    if dispatch not in DISPATCH_STYLES:
        raise ValueError(f"dispatch must be one of {DISPATCH_STYLES}, got {dispatch!r}")
    linecache.checkcache(SOURCE_FILE)
    sites: dict[str, list[int]] = {}
    for lineno, text in enumerate(linecache.getlines(SOURCE_FILE), start=1):
        m = _MARKER.match(text.strip())
        if m and m["style"] == dispatch:
            sites.setdefault(m["kind"], []).append(lineno)
    return sites


def dispatch_lines(dispatch: str, kinds=None) -> list[int]:
    """Sorted line numbers (in SOURCE_FILE) of the dispatch lines of style `dispatch`.

    By default only the lines that *cause* the data dependence: the torch.nonzero line for "mask", the
    torch.bincount and .tolist() lines for "sort" (see ORIGIN_KINDS; with sort_counts="preprocess" the bincount
    line does not run: use kinds=("tolist",)). Pass `kinds` (e.g. ("tolist",)) to pick
    others, or kinds="all" for every marked line (also gather / split / combine, which consume unbacked sizes).
    """
    sites = dispatch_sites(dispatch)
    if kinds is None:
        kinds = ORIGIN_KINDS[dispatch]
    elif kinds == "all":
        kinds = tuple(sites)
    elif isinstance(kinds, str):
        kinds = (kinds,)
    unknown = [k for k in kinds if k not in sites]
    if unknown:
        raise ValueError(f"no {dispatch!r} dispatch line of kind {unknown}; known kinds: {sorted(sites)}")
    return sorted(line for k in kinds for line in sites[k])

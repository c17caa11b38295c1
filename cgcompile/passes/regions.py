"""Module provenance -> tag regions. Reads the tags cgcompile.tag put on module classes from the
`nn_module_stack` Dynamo records on every node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch.fx as fx

from ..tagging import is_eager_region, tag_of
from .common import compute_nodes, module_stack


@dataclass(frozen=True)
class RegionInfo:
    """Where a node comes from: its innermost module path, the tagged modules around it (outermost first),
    and the path of an enclosing eager_region, if any."""

    module: Optional[str]
    tagged: Tuple[Tuple[str, str], ...]  # ((module path, tag), ...)
    eager_module: Optional[str]

    def innermost_tag(self, among=None) -> Optional[Tuple[str, str]]:
        """The innermost (path, tag) whose tag is in `among` (any tag when `among` is None)."""
        for path, name in reversed(self.tagged):
            if among is None or name in among:
                return path, name
        return None


def module_regions(gm: fx.GraphModule) -> Dict[fx.Node, RegionInfo]:
    regions: Dict[fx.Node, RegionInfo] = {}
    for node in compute_nodes(gm):
        stack = module_stack(node)
        tagged = tuple((path, tag_of(cls)) for path, cls in stack if isinstance(cls, type) and tag_of(cls))
        eager = next((path for path, cls in stack if isinstance(cls, type) and is_eager_region(cls)), None)
        regions[node] = RegionInfo(stack[-1][0] if stack else None, tagged, eager)
    return regions

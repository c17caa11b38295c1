"""The partition plan as plain data: which node runs in which partition, captured or eager, and why.

Written by planner.py, read by the split (split.py), the runtimes, and the renderers (diagnostics.py, visual.py),
which import this module, never the reverse. `to_json()` gives each record as JSON-ready data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .passes.batch_rows import BatchBoundary
from .passes.dtensor import Redistribution
from .reasons import Finding

CAPTURE, EAGER = "capture", "eager"
LAYER_SCOPE, BLOCK_SCOPE = "layer", "block"
OFF_SCOPE = "off"  # graphs of a kind the config does not capture (e.g. no-grad graphs with inference scope none)


def submodule_name(partition_id: int) -> str:
    """The split graph's submodule of a partition (split.py; torch.fx's split_module names them so)."""
    return f"submod_{partition_id}"


@dataclass
class Partition:
    """A contiguous run of nodes that is either captured as one graph or run eagerly."""

    id: int
    kind: str
    tags: Tuple[str, ...]
    module: Optional[str]
    num_ops: int
    reasons: Tuple[Finding, ...]
    nodes: Tuple[str, ...] = field(repr=False)
    # dynamic_padding applied to rows this partition works on: {"mode", "producers", "rows" (static bounds),
    # "buckets" (buckets mode; [] = powers of two)}; None when nothing in it is padded
    padding: Optional[dict] = None
    # the collectives its DTensor redistributions run in the forward graph (tensor parallelism), in graph order
    redistributions: Tuple[Redistribution, ...] = ()

    @property
    def tag(self) -> Optional[str]:
        return self.tags[0] if self.tags else None

    @property
    def captured(self) -> bool:
        return self.kind == CAPTURE

    def to_json(self) -> dict:
        return {"id": self.id, "kind": self.kind, "tag": self.tag, "tags": list(self.tags), "module": self.module,
                "num_ops": self.num_ops, "reasons": [r.to_json() for r in self.reasons], "padding": self.padding,
                "redistributions": [r.to_json() for r in self.redistributions]}


@dataclass
class GraphPlan:
    """The plan of one Dynamo graph. `findings` keeps every finding per node name for DEBUG logs."""

    index: int
    partitions: List[Partition]
    scope: str
    device: str
    training: bool
    findings: Dict[str, Tuple[Finding, ...]] = field(default_factory=dict, repr=False)
    # capture_sizes: the batch symbol padded to the capture sizes ("s0"), and why padding is refused (a
    # not_paddable Finding); both None when the option is off or the frame's batch is static.
    batch_symbol: Optional[str] = None
    batch_padding_refused: Optional[Finding] = None
    # where the batch sits at the frame's boundary, when capture_sizes pads it (passes/batch_rows.py)
    batch_boundary: Optional[BatchBoundary] = None
    # capture_sizes on, and the frame's first non-parameter tensor input has a static batch of 1: Dynamo traced a
    # batch of 1 as a frame of its own (it specializes sizes 0 and 1), which padding cannot reach
    static_batch_of_one: bool = False

    @property
    def node_to_partition(self) -> Dict[str, int]:
        return {name: p.id for p in self.partitions for name in p.nodes}

    @property
    def captured(self) -> List[Partition]:
        return [p for p in self.partitions if p.captured]

    def runner_name(self, partition: Partition) -> str:
        """What logs, stats() and the runtime call a captured partition of this graph: "graph 0 submod_3"."""
        return f"graph {self.index} {submodule_name(partition.id)}"

    def to_json(self) -> dict:
        return {"index": self.index, "scope": self.scope, "device": self.device, "training": self.training,
                "partitions": [p.to_json() for p in self.partitions], "batch_symbol": self.batch_symbol,
                "batch_padding_refused": (self.batch_padding_refused.to_json()
                                          if self.batch_padding_refused else None),
                "batch_boundary": self.batch_boundary.to_json() if self.batch_boundary else None}


@dataclass(frozen=True)
class GraphBreak:
    """A break Dynamo made itself (the code around it lands in separate graphs, the break runs in Python)."""

    reason: str
    location: Optional[str]
    hint: Optional[str] = None  # the fix, where cgcompile knows one

    def to_json(self) -> dict:
        return {"reason": self.reason, "location": self.location, "hint": self.hint}



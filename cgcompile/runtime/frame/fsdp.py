"""FSDP2 (`fully_shard`) under captured graphs: the unsharded parameters a graph reads stay at one address.

FSDP2 builds each unsharded parameter once, then frees its storage after every use and allocates it again for
the next all-gather, at a new address; a graph that read it would be captured again on every step. So:
- reshard_after_forward=False (the parameter stays unsharded from forward through backward anyway): the graphs
  are captured and FSDP2 is told to keep the storage of the parameters they read (`FsdpKeeper`). FSDP2 still
  all-gathers every step, into the same storage; the step's peak memory is eager's, and those unsharded bytes
  stay resident between steps too (logged at INFO with the names and the bytes).
- reshard_after_forward=True: keeping them would hold every layer unsharded at once, the memory this setting
  exists to save. The ops reading them are planned eager (reason `fsdp_resharded_params`, `resharded_inputs`)
  unless option `fsdp_keep_unsharded` asks to keep them as above.
`cgcompile.release()`, or the compiled frame going away, gives FSDP2 its own freeing back and frees what it
would have freed.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch.fx as fx

from ... import _compat
from ...passes.fsdp import fsdp_inputs, placeholders
from .. import release as releases

log = logging.getLogger("cgcompile")

_NAMES_SHOWN = 4


def keeper_for(gm: fx.GraphModule, example_inputs: Sequence[Any], captured_nodes: frozenset,
               graph: str) -> Optional["FsdpKeeper"]:
    """The keeper for a compiled frame whose captured partitions read FSDP2 parameters, else None."""
    found = fsdp_inputs(example_inputs)
    if not found:
        return None
    names = placeholders(gm)
    positions = [i for i in sorted(found) if any(user.name in captured_nodes for user in names[i].users)]
    return FsdpKeeper(positions, graph) if positions else None


class FsdpKeeper:
    """Per compiled frame: before each call, make FSDP2 keep the storage of the unsharded parameters at
    `positions` (the frame's inputs that captured partitions read). Dynamo reuses one frame for every layer
    of a model, so each call may pass other parameters: the new ones are looked up and kept once."""

    def __init__(self, positions: Sequence[int], graph: str):
        self.positions = tuple(positions)
        self.graph = graph
        self.seen: Dict[int, weakref.ref] = {}  # id(parameter) -> the parameter, for those handled already
        self.kept: List[weakref.ref] = []  # FSDP2's FSDPParam objects this keeper changed
        releases.register(self)
        # A frame Dynamo drops (reset, recompile) takes its keeper along: FSDP2 frees those parameters again
        weakref.finalize(self, _give_back, self.kept)

    def keep(self, args: Sequence[Any]) -> None:
        new = [args[i] for i in self.positions if not self._seen(args[i])]
        if new:
            self._keep(new)

    def _seen(self, tensor: Any) -> bool:
        ref = self.seen.get(id(tensor))
        return ref is not None and ref() is tensor

    def _keep(self, tensors: List[Any]) -> None:
        params = {id(p.unsharded): p for p in _compat.fsdp2_params()}
        kept = []
        for tensor in tensors:
            self.seen[id(tensor)] = weakref.ref(tensor)
            param = params.get(id(tensor))
            if param is None or param.unsharded is not tensor:
                continue  # not an FSDP2 parameter in this call: nothing to keep
            _compat.fsdp2_keep_unsharded(param.handle)
            self.kept.append(weakref.ref(param.handle))
            kept.append(param)
        if kept:
            names = ", ".join(p.fqn for p in kept[:_NAMES_SHOWN])
            more = f" and {len(kept) - _NAMES_SHOWN} more" if len(kept) > _NAMES_SHOWN else ""
            log.info("cgcompile: %s: FSDP2 keeps %d unsharded parameters resident for captured graphs, %s bytes on "
                     "this rank (it would free them after each use; cgcompile.release() lets it again): %s%s",
                     self.graph, len(kept), f"{sum(p.nbytes for p in kept):,}", names, more)

    def release(self) -> None:
        """FSDP2 frees these parameters again (now, for those resharded); the next call keeps them anew."""
        _give_back(self.kept)
        self.seen = {}


def _give_back(kept: List[weakref.ref]) -> None:
    """Give FSDP2 its own freeing back for the FSDPParam objects in `kept` (emptied in place)."""
    for ref in kept:
        handle = ref()
        if handle is not None:
            _compat.fsdp2_restore_free(handle)
    kept.clear()

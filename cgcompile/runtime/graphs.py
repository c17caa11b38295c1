"""One captured graph (`_Graph`) and the buffer rules it implements: how each argument of a call reaches the
graph's static inputs, what a replay hands out, when a graph is busy, when a backward's grads may be stolen.

Split out of local.py so that these rules sit next to the code that keeps them. `_Family` (local.py) applies
them when it captures (classifying each argument, restoring inputs the capture wrote) and when it picks the
instance a call replays; ModelRuntime (model_runtime.py) keeps the registry of which graph owns which memory,
and the pool rules. The buffer rules, in one place:

- Static inputs (parameters, buffers) are never copied: their address is recorded at capture and checked at
  replay; a moved one re-captures (counted in stats()["recaptures"]). Other parameters altogether (Dynamo
  reuses one compiled frame for every layer when layers graph-break) get graphs of their own.
- An input living in memory owned by another captured graph (the previous partition's output, the saved
  activations a backward receives) is *borrowed*: no copy, and the graph only replays for that same address.
- Everything else is copied into a static buffer owned by the graph (skipped when it is already there).
- Forward/inference outputs are handed out as fresh aliases (`detach()`), never the static tensors: autograd
  attaches grad_fn to the returned objects, so one object reused across calls would corrupt the earlier
  call's graph. A graph is *busy* while an alias from its last replay is alive (saved for backward, held by
  the caller) or anything else outside the runtime references its memory (a view or `.detach()` copy,
  seen through storage use counts). A busy graph is never replayed; the call uses another *instance* of it
  (captured on demand, like Megatron's per-microbatch graphs), which is what makes fwd, fwd, bwd, bwd
  correct. Instances count against `max_graphs_per_partition` (per parameter set, i.e. per layer); past it
  the call runs eagerly.
- A backward graph belongs to one forward instance: autograd hands the backward the very alias objects the
  forward replay returned (they carry their graph), else memory only that instance owns identifies it; it
  is captured at that instance's first backward. Since a busy instance never replays, an instance has at
  most one pending backward.
- Backward outputs: returned as the held static tensors themselves, AccumulateGrad cannot steal one as
  `param.grad` and clones it (a kernel per parameter per step, which eager does not pay). So once a backward
  graph has seen its parameters' grads cleared (`zero_grad(set_to_none=True)`) before two replays in a row,
  it hands out aliases instead, which AccumulateGrad steals: `param.grad` is then the graph's memory, and the
  graph (with its forward instance, and under the pool rule every earlier shared-pool graph) stays busy until
  the grads are released. A loop that keeps grads (accumulation, `set_to_none=False`) never gets there, and
  one that keeps them after stealing began turns stealing off for that graph (the call that found the grads
  held takes another instance or runs eagerly; if they are never released, e.g. `set_to_none=False` from
  then on, that instance stays unused, its memory being `.grad`).
- Inputs the graph itself writes (Inductor keeps some input mutations in its graphs) are restored after
  capture, which runs the graph once, and copied back to the caller's tensor after each replay.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from .. import _compat
from ..counters import add as _count
from .driver import CaptureError, CapturedGraph
from .layout import copy_into, same_repeats, static_copy, uncopyable_reason

if TYPE_CHECKING:
    from .local import _Family
    from .model_runtime import ModelRuntime

log = logging.getLogger("cgcompile")

# How a call argument reaches a graph's static input.
_CONST, _PARAM, _BORROWED, _OWNED = "const", "param", "borrowed", "owned"
_MISMATCH = object()  # match(): this graph was captured for other addresses/values; try another instance


def is_static_tensor(arg: Any) -> bool:
    """A parameter or buffer seen at run time: nn.Parameter, or a tensor Dynamo marked static (it marks module
    buffers too). Their addresses stay fixed between calls, so graphs read them in place."""
    return isinstance(arg, torch.nn.Parameter) or (
        isinstance(arg, torch.Tensor) and hasattr(arg, "_dynamo_static_input_type"))


def _storage_ptr(t: torch.Tensor) -> int:
    return _compat.storage_key(t)[0]


# --- one captured graph --------------------------------------------------------------------------------------


class _Graph:
    """One captured graph, and how each argument of a call reaches its static inputs."""

    def __init__(self, family: "_Family", captured: CapturedGraph, kinds: List[str], param_storages: frozenset,
                 capture_seconds: float):
        self.family = family
        self.captured: Optional[CapturedGraph] = captured
        self.kinds = kinds
        self.param_storages = param_storages
        self.capture_seconds = capture_seconds
        inputs = captured.static_inputs
        self.param_ptrs = {i: inputs[i].data_ptr() for i, k in enumerate(kinds) if k is _PARAM}
        self.param_refs: Dict[int, weakref.ref] = {}  # the caller's parameter objects, to tell "moved" apart
        # match() runs on every call: the expected address or value per position, computed once here.
        self.param_checks = list(self.param_ptrs.items())
        self.borrow_checks = [(i, inputs[i].data_ptr()) for i, k in enumerate(kinds) if k is _BORROWED]
        self.const_checks = [(i, inputs[i]) for i, k in enumerate(kinds) if k is _CONST]
        self.copies = [i for i, k in enumerate(kinds) if k is _OWNED]
        # an expanded buffer takes only arguments that repeat along the same dimensions
        self.repeat_checks = [(i, inputs[i]) for i in self.copies if 0 in inputs[i].stride()]
        self.copy_back: List[int] = []  # copied-in inputs the graph writes: the caller's tensor gets the result
        self.owned: Dict[int, List[int]] = {}  # storage ptr -> [storage handle, use count when idle]
        self.borrowed_from: List[Tuple[_Graph, int, int]] = []  # (lender, storage ptr, references we keep)
        self.shared_index: Optional[int] = None
        self.replays = 0
        self.handed: List[weakref.ref] = []  # the aliases the last replay handed out
        self.free = False  # seen idle since its last replay: stays so until the next replay (see busy())
        self.bw: Optional[_Graph] = None  # a forward instance's backward graph
        self.cleared_streak = 0  # backward: replays in a row that found the parameters' grads cleared

    def memory(self) -> Dict[str, int]:
        """Bytes this graph holds: its pool reservation, its copied-in input buffers, its own outputs."""
        inputs = self.captured.static_inputs
        nbytes = {_compat.storage_key(t)[0]: t.untyped_storage().nbytes() for t in inputs
                  if isinstance(t, torch.Tensor)}
        buffers = sum(nbytes[_storage_ptr(t)] for t, k in zip(inputs, self.kinds) if k is _OWNED)
        outputs = {_storage_ptr(t): t.untyped_storage().nbytes() for t in self.captured.static_outputs
                   if isinstance(t, torch.Tensor) and _storage_ptr(t) not in nbytes}
        return {"pool_bytes": self.captured.pool_bytes, "static_input_bytes": buffers,
                "static_output_bytes": sum(outputs.values())}

    def owned_storages(self) -> List[Tuple[int, int]]:
        """Storages this graph owns: its copied-in input buffers and outputs not aliasing other inputs."""
        inputs = self.captured.static_inputs
        foreign = {_storage_ptr(t) for t, k in zip(inputs, self.kinds) if k in (_PARAM, _BORROWED)}
        found: Dict[int, int] = {}
        candidates = [t for t, k in zip(inputs, self.kinds) if k is _OWNED] + list(self.captured.static_outputs)
        for t in candidates:
            if isinstance(t, torch.Tensor):
                ptr, sid = _compat.storage_key(t)
                if ptr and ptr not in foreign:
                    found.setdefault(ptr, sid)
        return list(found.items())

    @property
    def steal(self) -> bool:
        """Backward: hand out aliases that AccumulateGrad may keep as param.grad (grads seen cleared twice)."""
        return self.cleared_streak >= 2

    def busy(self) -> bool:
        """Is an alias from the last replay alive (e.g. saved for a pending backward), or does anything
        besides the runtime still reference this graph's memory (a view, a `.detach()`ed copy)?

        Once idle, a graph stays idle until its next replay: new references to its memory come only from
        a replay's aliases, or from a borrower replaying on it, which needs a live reference already.
        So the result is cached, which keeps the pool rule's scans cheap.

        A backward graph found busy while it hands out stealable grads stops doing so: the loop keeps the
        grads it was given (see the module docstring).
        """
        if self.free:
            return False
        if any(ref() is not None for ref in self.handed) or any(
                _compat.storage_use_count(sid) > idle for sid, idle in self.owned.values()):
            if self.steal:
                self.cleared_streak = 0
                log.debug("cgcompile: %s: gradients kept across steps; backward outputs are copied from now on",
                          self.family.part.describe())
            return True
        self.free = True
        return False

    def match(self, args: Sequence[Any]) -> Any:
        """None if this graph can run `args`; else _MISMATCH (captured for other addresses, e.g. another
        layer's parameters when Dynamo reuses one compiled frame for every layer), or a reason string when
        one of *its own* static inputs has moved since capture (the graph is stale: re-capture it)."""
        for i, ptr in self.param_checks:
            if args[i].data_ptr() != ptr:
                return self.moved(i) or _MISMATCH
        for i, ptr in self.borrow_checks:
            if args[i].data_ptr() != ptr:
                return _MISMATCH
        for i, value in self.const_checks:
            arg = args[i]
            if isinstance(arg, torch.Tensor) or arg != value:
                return _MISMATCH
        for i, buf in self.repeat_checks:
            if not same_repeats(buf, args[i]):
                return _MISMATCH
        return None

    def moved(self, i: int) -> Optional[str]:
        """Why this graph is stale, if the parameter it was captured with at position i now lives elsewhere
        (else the call simply passes another parameter, e.g. another layer's)."""
        ref = self.param_refs.get(i)
        param = ref() if ref is not None else None
        if param is not None and param.data_ptr() != self.param_ptrs[i]:
            return f"static input {i} moved (parameter or buffer re-allocated)"
        return None

    def replay(self, args: Sequence[Any], runtime: ModelRuntime, alias: bool) -> List[Any]:
        inputs = self.captured.static_inputs
        with torch.no_grad():
            for i in self.copies:
                arg, buf = args[i], inputs[i]
                if arg.data_ptr() != buf.data_ptr():
                    copy_into(buf, arg)
            self.free = False
            outputs = list(self.captured.replay())
            for i in self.copy_back:
                if args[i].data_ptr() != inputs[i].data_ptr():
                    args[i].copy_(inputs[i])
            self.handed = []
            if alias:
                outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]
                for out in outputs:
                    if isinstance(out, torch.Tensor):
                        if self.family.kind != "backward":
                            out._cgcompile_graph = self  # lets the backward find its forward instance
                        self.handed.append(weakref.ref(out))
        _count("replays")
        runtime.note_replay(self)
        return outputs


# --- static input buffers, written inputs --------------------------------------------------------------------


def _mutated_inputs(gm: fx.GraphModule) -> frozenset:
    """Positions of gm's inputs that an op in gm writes (per the op schemas' alias annotations)."""
    positions = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    mutated = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, fx.Node) and value in positions:
                mutated.add(positions[value])
    return frozenset(mutated)


def _static_buffer(t: torch.Tensor, index: int, name: Optional[str] = None) -> torch.Tensor:
    """A copy of t with t's exact layout (expanded, strided, offset or empty), owned by a graph."""
    reason = uncopyable_reason(t)
    if reason is not None:
        raise CaptureError(f"input {name or index} cannot be copied into a static buffer: {reason}")
    with torch.no_grad():
        return static_copy(t)

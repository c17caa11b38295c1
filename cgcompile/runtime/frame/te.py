"""cuda_graph_impl="transformer_engine": the captured partitions of a frame are graphed together by Transformer
Engine's `make_graphed_callables` (forwards in order, backwards in reverse, one memory pool).

The frame first runs `cuda_graph_warmup_steps` eager calls (at least one, to record real sample arguments for
every partition), then hands all captured partitions to the graphing function at once. The graphing function is
injectable (`options["te"]["graphing_fn"]`), so the glue is tested with torch.cuda.make_graphed_callables, which
has the same contract, on a GPU, and with te_emulation.emulated_make_graphed_callables (that contract on the CPU)
in the tests. Every other key of `options["te"]` is passed to it unchanged (fp8_enabled, fp8_recipe, fp8_group,
num_warmup_iters, ...).

TE's restrictions, and where each is handled: tensor-only arguments and outputs are checked at plan time
(planner.py reports a `te_restriction` reason and keeps such a partition eager); module hooks cannot bite,
because the callables handed over are split FX submodules (Dynamo already inlined the user's hooks into the
graph) and carry none; train/eval consistency holds because Dynamo guards on the training flag, so eval mode
compiles a separate frame, and no-grad frames are not graphed at all (transformer_engine has no inference scope).

What make_graphed_callables' contract adds (torch's, checked 2.11 and 2.13, and TE's): the split submodules own no
parameters (Dynamo passes them as arguments), so parameters and buffers are passed as sample arguments: fresh
leaves on the very memory the frame passes, never the parameter objects themselves (see `_sample`); a frame Dynamo
reuses for several layers is not graphed (see `_static_key`). A partition with a grad-requiring input that reaches none of its differentiable outputs makes
graphing fail unless `te={"allow_unused_input": True}` (both functions take it); the frame then runs eagerly, with
the reason logged. A second forward before the first backward (gradient accumulation over micro-batches run as
fwd, fwd, bwd, bwd) is not supported by make_graphed_callables: it keeps one static instance per callable.

What the frame adds around the graphed callables (see _Graphed), because each returns static buffers:
- outputs: the frame's outputs that live in a graphed callable's output memory are cloned (option
  `clone_outputs`, on by default), so an output kept across calls is not overwritten by the next one;
- gradients: a parameter's gradient is copied out of the static buffer before it reaches `.grad` (when `.grad` is
  None, autograd would keep the buffer itself as `.grad`, and the next micro-batch's replays overwrite it before
  its gradient is added). One copy of each parameter gradient per backward;
- the autocast weight cache is off while graphing (make_graphed_callables refuses it: cached casts would be freed
  under the captured graph); casts are recomputed inside the graphs instead, with the same values;
- graphing runs on the frame's device (a model on cuda:1 while the current device is 0), and the callables handed
  over are thin wrappers, so the forward a module callable gets replaced with is not the split submodule's own
  (release() then runs the submodules eagerly again).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ... import _compat, counters
from ...errors import ConfigError
from ...split import replace_submodule
from ..drivers.cuda import end_generator_capture
from ..drivers.thread_state import preserved_global_state
from ..tensors import is_param_or_buffer, storage_ptr
from ..release import register

log = logging.getLogger("cgcompile")

__all__ = ["TEFrame", "resolve_graphing_fn"]

GRAPHING_FN_KEY = "graphing_fn"


def _load_te_graphing_fn() -> Callable[..., Any]:
    try:
        from transformer_engine.pytorch import make_graphed_callables
    except Exception as exc:  # ImportError, or TE's own load errors without CUDA
        raise ConfigError(
            f"cuda_graph_impl='transformer_engine' needs Transformer Engine's PyTorch package, which could not be "
            f"imported ({type(exc).__name__}: {exc}). Install it on a CUDA machine with "
            f"pip install \"cgcompile[te]\", or use cuda_graph_impl='local' (cgcompile's own runtime).") from None
    return make_graphed_callables


def resolve_graphing_fn(te_options: Dict[str, Any]) -> Tuple[Callable[..., Any], Dict[str, Any]]:
    """(graphing function, the options to pass it): the injected one, else TE's, else one clear ConfigError."""
    options = dict(te_options)
    fn = options.pop(GRAPHING_FN_KEY, None)
    return (fn if fn is not None else _load_te_graphing_fn()), options


def _static_key(args: Sequence[Any]) -> tuple:
    """Which parameters and buffers a frame call passes (by object).

    Dynamo reuses one compiled frame for every layer when the layers graph-break, so one frame may run several
    parameter sets. The graphed callables of make_graphed_callables (torch's and TE's) copy each argument into
    their sample tensor, which for a parameter shares its memory: a call with another layer's parameters
    would overwrite the graphed layer's. So a frame is graphed only when it has seen one parameter set.
    """
    return tuple(id(a) for a in args if is_param_or_buffer(a))


def _sample(arg: Any) -> Any:
    """A sample argument for graphing: a parameter or buffer becomes a fresh leaf on the same memory; other
    tensors are copied so later steps cannot change them before the graphing call.

    make_graphed_callables (torch's and TE's) makes the sample tensors the graphs' static inputs: every call
    copies its argument into the sample unless both share an address, and the graph reads and writes the
    sample. So a parameter's or buffer's sample must share its memory (no copy per call; a graph's in-place
    updates, BatchNorm running stats, land in the module's buffer), but it must not be the parameter object:
    the parameter's AccumulateGrad node belongs to the caller's autograd graph (a previous step's loss held
    in a variable keeps it alive) and carries the stream it was created on, the default stream. Autograd
    sends the captured backward's gradients to that stream (InputBuffer::add, leaf-stream sync), a stream
    that cannot join the capture, and the capture fails ("operation failed due to a previous error during
    capture"). A detached alias has no grad accumulator yet; the one made during graphing lives on the
    graphing streams. Gradients still reach the parameter: the graphed function returns them to the
    caller's autograd, which accumulates them into the tensor actually passed, the parameter."""
    if not isinstance(arg, torch.Tensor):
        return arg
    if is_param_or_buffer(arg):
        return arg.detach().requires_grad_(arg.requires_grad)
    return arg.detach().clone().requires_grad_(arg.requires_grad)


class _SampleRecorder(torch.nn.Module):
    """Runs a partition eagerly and keeps the arguments of its latest call as graphing samples."""

    def __init__(self, submod: fx.GraphModule):
        super().__init__()
        self.submod = submod
        self.sample: Tuple[Any, ...] = ()

    def forward(self, *args: Any) -> Any:
        self.sample = tuple(_sample(a) for a in args)
        return self.submod(*args)


class _Graphable(torch.nn.Module):
    """What the graphing function gets for a partition: a fresh module around it, whose forward it may replace
    (make_graphed_callables does that to module callables) without touching the split submodule."""

    def __init__(self, submod: fx.GraphModule):
        super().__init__()
        self.submod = submod

    def forward(self, *args: Any) -> Any:
        return self.submod(*args)


class _GradCopy(torch.autograd.Function):
    """Identity forward (a view: same address, so the graphed callable copies nothing in); its backward copies the
    gradient out of the graphed callable's static buffer before autograd accumulates it into `.grad`."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone()


class _Graphed:
    """A graphed callable as the frame calls it: parameters' gradients copied out of its static buffers, and the
    storages of its outputs noted (static: the same every call) so the frame can clone what it returns of them."""

    def __init__(self, fn: Callable[..., Any], outputs: set):
        self.fn = fn
        self.outputs = outputs

    def __call__(self, *args: Any) -> Any:
        args = tuple(_GradCopy.apply(a) if is_param_or_buffer(a) and a.requires_grad and torch.is_grad_enabled() else a
                     for a in args)
        out = self.fn(*args)
        self.outputs.update(storage_ptr(t) for t in _compat.tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


@contextlib.contextmanager
def _autocast_cache_off() -> Iterator[None]:
    """make_graphed_callables (torch's and TE's) refuses an active autocast whose weight cache is on."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


class TEFrame:
    """A split frame whose captured partitions are graphed together after the warmup calls."""

    def __init__(self, split_gm: fx.GraphModule, captured: Sequence[str], graphing_fn: Callable[..., Any],
                 te_options: Dict[str, Any], warmup_steps: int, clone_outputs: bool = True,
                 device: Optional[torch.device] = None):
        self.split_gm = split_gm
        self.names = list(captured)
        self.graphing_fn = graphing_fn
        self.te_options = te_options
        self.warmup_steps = max(1, warmup_steps)
        self.clone_outputs = clone_outputs
        self.device = device if device is not None and device.type == "cuda" else None
        self.static_outputs: set = set()  # storages of the graphed callables' outputs
        # calls, graphed, and the parameter sets seen (see _static_key) and graphed: set by release()
        self.calls, self.graphed, self.graphed_key = 0, False, None
        self.static_keys: set = set()
        self.recorders = [_SampleRecorder(getattr(split_gm, name)) for name in self.names]
        self.release()
        register(self)

    def release(self) -> None:
        """Un-graph (cgcompile.release()): the recorders run again, and the frame graphs anew after warmup."""
        for name, recorder in zip(self.names, self.recorders):
            replace_submodule(self.split_gm, name, recorder)
        self.calls, self.graphed, self.graphed_key = 0, False, None
        self.static_keys = set()

    def __call__(self, *args: Any) -> Any:
        key = _static_key(args)
        if not self.graphed:
            self.static_keys.add(key)
            if self.calls >= self.warmup_steps and torch.is_grad_enabled():
                self._graph(key)
        elif self.graphed_key is not None and key != self.graphed_key:
            # The graphed callables would copy this call's parameters into the graphed set's (see _static_key):
            # stop using them; the eager partitions are right for every parameter set.
            self.graphed_key = None
            self._fall_back(self.recorders, "transformer_engine graphing dropped: the frame was called with another "
                                            "parameter set than the one it was graphed with (Dynamo reuses one "
                                            "frame for every layer when layers graph-break); use "
                                            "cuda_graph_impl='local', which captures graphs per parameter set")
        self.calls += 1
        out = self.split_gm(*args)
        if self.graphed_key is None or not self.clone_outputs:
            return out
        static = self.static_outputs
        flat, spec = _compat.tree_flatten(out)
        return _compat.tree_unflatten([t.clone() if isinstance(t, torch.Tensor) and storage_ptr(t) in static else t
                                       for t in flat], spec)

    def _graph(self, key: tuple) -> None:
        self.graphed = True
        recorders = self.recorders
        callables = tuple(_Graphable(r.submod) for r in recorders)
        samples = tuple(r.sample for r in recorders)
        if len(self.static_keys) > 1:
            self._fall_back(recorders, f"transformer_engine graphing skipped: the frame runs {len(self.static_keys)} "
                                       f"parameter sets (one per layer: Dynamo reuses the frame when layers graph-"
                                       f"break) and make_graphed_callables graphs one; use cuda_graph_impl='local'")
            return
        failure: Optional[Exception] = None
        with torch.cuda.device(self.device) if self.device is not None else contextlib.nullcontext():
            stream = torch.cuda.current_stream() if self.device is not None else None
            try:
                with preserved_global_state(rng=True), _autocast_cache_off():  # warmup must not shift random streams
                    graphed = self.graphing_fn(callables, samples, **self.te_options)
            except Exception as exc:
                failure = exc
                if stream is not None:
                    # torch.cuda.graph.__exit__ (2.11, 2.13) raises from capture_end() before restoring the stream
                    # it switched to; without this, everything after a failed capture would run on that stream.
                    torch.cuda.set_stream(stream)
                    if _compat.generator_capture_state_outlives_failure():
                        end_generator_capture(self.device)  # 2.11: the default generator may be left capturing
        if failure is not None:
            reason = f"{type(failure).__name__}: {failure}".splitlines()[0]
            self._fall_back(recorders, f"transformer_engine graphing failed: {reason}")
            return
        graphed = graphed if isinstance(graphed, (tuple, list)) else (graphed,)
        self.static_outputs = set()
        for name, fn in zip(self.names, graphed):
            replace_submodule(self.split_gm, name, _Graphed(fn, self.static_outputs))
        self.graphed_key = key
        counters.add("graphs_captured", 2 * len(callables))
        log.info("cgcompile: transformer_engine graphed %d partitions", len(callables))

    def _fall_back(self, recorders: List[_SampleRecorder], reason: str) -> None:
        """Run the partitions eagerly for good: log once, count per partition."""
        for name, rec in zip(self.names, recorders):
            replace_submodule(self.split_gm, name, rec.submod)
            counters.record("eager_fallbacks", name, reason, once=True)
        log.warning("cgcompile: %d partitions run eagerly: %s", len(recorders), reason)

"""The one place cgcompile touches private torch APIs.

Each wrapper names the private API it uses and the torch versions it was checked against (2.13 CPU here,
2.11 on the GPU image). When torch moves one of them, this package is the only place to fix: this module, and
beside it cuda.py (CUDA graph pools and generators in captures) and fsdp.py (FSDP2's parameter state), whose
names it re-exports, so the rest of cgcompile asks `_compat` alone.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["ADDRESS_CHECK_IMPL", "ADDRESS_CHECK_IMPLS", "AddressCheck", "any_autocast", "aot_compile",
           "at_backward_end", "boxed", "by_position_check", "copy_all", "cuda_end_allocate_to_pool",
           "cuda_release_pool", "compile_id", "direct_inference", "donated_inputs", "dynamo_frame",
           "fsdp2_keep_unsharded", "fsdp2_params", "fsdp2_restore_free", "FsdpParam", "functorch_level",
           "generator_capture_state_outlives_failure", "increment_versions", "is_unregistered_generator_error",
           "is_wrapper_subclass", "never_traced", "pop_functorch_level", "resolve_overload", "set_grad_enabled",
           "set_versions", "skip_frames_of", "storage_key", "storage_use_count", "storage_weak_ref",
           "TorchDispatchMode", "tree_flatten",
           "tree_unflatten"]

# torch.utils._pytree: the pytree helpers torch.compile itself uses; private module, stable API; checked 2.11, 2.13.
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: E402

# torch.utils._python_dispatch.TorchDispatchMode: a private module, stable since 1.13; checked 2.11, 2.13.
# is_traceable_wrapper_subclass from the same module: see is_wrapper_subclass.
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass  # noqa: E402

from .cuda import (cuda_end_allocate_to_pool, cuda_release_pool, generator_capture_state_outlives_failure,  # noqa: E402
                   is_unregistered_generator_error)
from .fsdp import FsdpParam, fsdp2_keep_unsharded, fsdp2_params, fsdp2_restore_free  # noqa: E402


def skip_frames_of(module_names: Sequence[str]) -> None:
    """Dynamo runs the frames of these modules (a package: every module under it) as written, never tracing them,
    as it does torch's own: torch._dynamo.trace_rules.add (private; its skip list, what Dynamo checks per code
    object once; checked 2.11, 2.13)."""
    from torch._dynamo import trace_rules

    for name in module_names:
        trace_rules.add(name)


def never_traced(fn: Callable) -> Callable:
    """`fn`, run with Dynamo's frame hook off, for it and everything it calls: torch.compiler.disable(recursive=True)
    (public). For what autograd calls during a backward pass that a compiled frame started (a graph break at
    `loss.backward()`): the hook is still set there, so the graph code `fn` runs would be traced as a new frame.
    Around a closure: disable's functools.wraps would copy `fn`'s attributes (a graph family's state) into a
    snapshot that keeps their values of that moment alive."""
    return torch.compiler.disable(lambda *args, **kwargs: fn(*args, **kwargs), recursive=True)


def aot_compile(mod: torch.fx.GraphModule, args: Sequence[Any],
                make_runner: Callable[[str, Callable[[list], Any], torch.fx.GraphModule, Optional[tuple]],
                                      Callable[[list], Any]], *,
                inductor: bool = False) -> Callable[..., Any]:
    """Run aot_autograd over `mod` (which must return a tuple) and return its positional callable.

    For every graph aot produces ("forward", "backward" or "inference"), `make_runner(kind, run, gm, direct)`
    (`run(args: list)` runs that graph uncaptured; `gm` is the aten graph before Inductor; `direct`: see
    direct_inference) returns what aot will call instead (boxed: one list argument). `args` may be real tensors:
    aot fakifies them in the FakeTensorMode of the tracing context opened here, where it records the graphs'
    metadata (TracingContext.fw_metadata).

    - inductor=False: torch._functorch.aot_autograd.aot_module_simplified (checked 2.11, 2.13); `run` calls
      the aten graph module. keep_inference_input_mutations=True (as Inductor sets it): an inference graph's
      writes to its inputs (a KV cache buffer) stay in the graph as `copy_`, so they are captured, instead of
      running after it as aot's per-call epilogue (one eager copy per mutated input, outside the graph).
    - inductor=True: torch._inductor.compile_fx.compile_fx with a custom `inner_compile` (checked 2.11, 2.13),
      so Inductor's decompositions, joint-graph passes and partitioner apply, and each graph is compiled by
      compile_fx_inner. Inductor's own cudagraphs are forced off (we capture), and the AOTAutograd cache is
      off (a cache hit would return compiled graphs without calling inner_compile, i.e. without capture)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    num_args = len(args)  # not `args`: a closure over them would keep the first call's tensors alive
    # aot unwraps tensor subclasses (DTensor) in its runtime wrapper, so their graphs are never called directly.
    # Told by the arguments themselves: torch 2.11's fw_metadata describes the unwrapped inputs, all plain.
    wrapped = any(map(is_wrapper_subclass, args))
    if not inductor:
        from torch._functorch.aot_autograd import aot_module_simplified

        def compiler(kind: str) -> Callable:
            def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
                direct = direct_inference(gm, num_args) if kind == "inference" and not wrapped else None
                return boxed(untraced_in_backward(kind, make_runner(kind, lambda graph_args: gm(*graph_args), gm,
                                                                     direct)))
            return untraced_in_backward(kind, compile_graph)

        with tracing(TracingContext(FakeTensorMode())):
            return aot_module_simplified(mod, list(args), fw_compiler=compiler("forward"),
                                         bw_compiler=compiler("backward"), inference_compiler=compiler("inference"),
                                         keep_inference_input_mutations=True)

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        kwargs["cudagraphs"] = None
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        direct = direct_inference(gm, num_args) if kind == "inference" and not wrapped else None
        return boxed(make_runner(kind, lambda graph_args: compiled(list(graph_args)), gm, direct))

    # A ShapeEnv with inputs fakified at static sizes (compile_fx's ignore_shape_env: checked 2.13, looked up) lets
    # Inductor's FX graph cache serve graphs compiled before (another layer's, an earlier run's): else "No shape env".
    cached = {"ignore_shape_env": True} if "ignore_shape_env" in inspect.signature(compile_fx).parameters else {}
    context = tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))) if cached else contextlib.nullcontext()
    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch({"triton.cudagraphs": False}), \
            context:  # compile_fx returns aot_module_simplified's positional forward for a GraphModule
        return compile_fx(mod, list(args), inner_compile=inner_compile, **cached)


def untraced_in_backward(kind: str, fn: Callable) -> Callable:
    """A backward graph's compiler (aot runs it lazily, inside the first backward pass) and runner never_traced;
    a forward or inference one as it is (Dynamo's compiled code calls it with the hook off already). What torch's
    own aot_autograd backend does to both (torch/_dynamo/backends/common.py, "Wrapping bw_compiler in disable";
    checked 2.13), so compile_fx (the Inductor inner compiler) needs nothing here; aot_module_simplified,
    called directly, does not do it."""
    return never_traced(fn) if kind == "backward" else fn


def direct_inference(gm: torch.fx.GraphModule, num_args: int) -> Optional[tuple]:
    """For an inference graph being compiled: when aot's runtime wrapper around it would only call it (no input
    mutation or output alias it applies after the graph, no intermediate bases, no effect tokens, no functionalized
    rng, no tensor subclass, the graph taking exactly the module's arguments, autocast off), the input positions
    whose version counters the wrapper bumps for mutations kept in the graph; else None. Reads the metadata aot
    records on the tracing context (torch/_functorch/_aot_autograd/schemas.py ViewAndMutationMeta; fields
    checked 2.11, 2.13; any one missing means None). Subclass arguments are the caller's to rule out (aot_compile):
    on 2.11 subclass_inp_meta describes the graph's unwrapped inputs, all plain."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    try:
        if (meta is None or meta.num_mutated_inp_runtime_indices or meta.num_intermediate_bases or meta.tokens
                or meta.is_rng_op_functionalized or torch._C._is_any_autocast_enabled()
                or any(info.output_type.name != "non_alias" for info in meta.output_info)
                or any(type(m).__name__ != "PlainTensorMeta" for m in meta.subclass_inp_meta if not isinstance(m, int))
                or sum(n.op == "placeholder" for n in gm.graph.nodes) != num_args):
            return None
        return tuple(meta.mutated_graph_handled_indices_seen_by_autograd)
    except AttributeError:
        return None


def donated_inputs() -> frozenset:
    """For the backward graph being compiled now (call it from the compiler aot calls): the positions of its inputs
    that aot_autograd donated, saved tensors nothing else reads (torch._functorch.config.donated_buffer, on by
    default). Inductor may reuse their memory for its own buffers (`buf0 = addmm_1; del addmm_1  # reuse`): its
    kernels then write these inputs where no op shows it. Reads fw_metadata.bw_donated_idxs on the tracing context,
    as torch._inductor.utils.get_donated_idxs does (checked 2.13); missing means none."""
    context = torch._guards.TracingContext.try_get()
    return frozenset(getattr(getattr(context, "fw_metadata", None), "bw_donated_idxs", None) or ())


def boxed(fn: Callable[[list], Any]) -> Callable[[list], Any]:
    """Mark `fn(args: list)` as using aot_autograd's boxed calling convention.

    aot's runtime (torch/_functorch/_aot_autograd/utils.py call_func_at_runtime_with_args, checked 2.11, 2.13)
    calls `f(args)` when `f._boxed_call` is true, else `f(*args)` with a deprecation warning."""
    fn._boxed_call = True  # type: ignore[attr-defined]
    return fn


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(data_ptr, handle) of t's storage; (0, 0) for an empty one (many empty storages share address 0).

    The handle, UntypedStorage._cdata (checked 2.11, 2.13), is what storage_use_count takes; it stays valid
    only while something keeps the storage alive (the runtime holds a tensor on every storage it tracks).
    """
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return 0, 0
    return storage.data_ptr(), storage._cdata


def is_wrapper_subclass(t: Any) -> bool:
    """Is t a traceable wrapper tensor subclass (DTensor, torchao's float8 / NF4 tensors): a tensor with no memory
    of its own whose data lives in the inner tensors `t.__tensor_flatten__()` names, which aot_autograd hands
    the compiled graphs in its place? torch.utils._python_dispatch.is_traceable_wrapper_subclass, the predicate
    aot_autograd's subclass flattening uses (private module; run on 2.11 and 2.13)."""
    return is_traceable_wrapper_subclass(t)


# storage_use_count(handle) -> int: how many tensors (and Python storage objects) hold the storage (the handle is
# storage_key's). torch._C._storage_Use_Count, bound as it is (it runs on every held check of a replay); used by
# torch/_inductor/cudagraph_trees.py the same way (checked 2.11, 2.13). Counting storage owners, not Python
# references to one tensor object, makes views, `.detach()` aliases and autograd's C++ SavedVariables all visible.
storage_use_count: Callable[[int], int] = torch._C._storage_Use_Count


def _any_autocast() -> Callable[[], bool]:
    """torch._C._is_any_autocast_enabled (private; checked 2.13; where absent, the two devices asked one by one)."""
    found = getattr(torch._C, "_is_any_autocast_enabled", None)
    return found if found is not None else lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")


# any_autocast() -> bool: is autocast on for any device (asked on every replay; the devices only when it is)
any_autocast: Callable[[], bool] = _any_autocast()


def _version_bumper() -> Callable[[Sequence[torch.Tensor]], None]:
    """torch._C._increment_version, what torch.autograd.graph.increment_version calls (private; checked 2.13: any
    iterable of tensors; tried once here: a build whose C function takes one tensor gets a loop over it)."""
    bump = torch._C._increment_version
    try:
        bump((torch.empty(0),))
    except (TypeError, RuntimeError):
        def one_by_one(tensors: Sequence[torch.Tensor]) -> None:
            for tensor in tensors:
                bump(tensor)

        return one_by_one
    return bump


def set_versions(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Put the tensors' version counters back to `versions`: torch._C._autograd._unsafe_set_version_counter (private;
    what Dynamo and FSDP2 use to hide their own writes from autograd; checked 2.13). The emulate driver hides its
    replays' writes with it, as a CUDA graph's kernels bump no version counter."""
    torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


# increment_versions(tensors): bump each tensor's version counter, as aot's wrapper does for inputs a graph writes.
increment_versions: Callable[[Sequence[torch.Tensor]], None] = _version_bumper()


_DATA_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
_DATA_PTR = torch.Tensor.data_ptr


def _compiled_address_check() -> Optional[Callable[[tuple, tuple], Callable[[Sequence[Any]], bool]]]:
    """cgcompile's compiled helper (cgcompile/csrc/address_check.cpp), set up to read a plain tensor's data pointer
    through torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr: the address of the C function
    `void* (PyObject*)` that Inductor's generated C++ kernel bindings read tensor arguments with (private; run on
    2.13; the helper is only set up where it exists). None where the helper was not built (no C++ compiler)."""
    try:
        from .. import _address_check
    except ImportError:
        return None
    reader = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    address = getattr(reader, "_torchinductor_pyobject_tensor_data_ptr", None)
    if not isinstance(address, int) or address <= 0:
        return None
    _address_check.setup(address, torch.Tensor, torch.nn.Parameter)
    prepare, equal = _address_check.prepare, _address_check.equal

    def compiled(indices: tuple, ptrs: tuple) -> Callable[[Sequence[Any]], bool]:
        return functools.partial(equal, prepare(indices, ptrs))

    return compiled


_COMPILED_CHECK = _compiled_address_check()


def by_position_check(equal: Callable[[list, list, list], bool], indices: Sequence[int],
                      ptrs: Sequence[int]) -> Callable[[Sequence[Any]], bool]:
    """A check through a function of torch's contract for `_tensors_data_ptrs_at_indices_equal(tensors, data_ptrs,
    indices)`: three lists, the expected pointers by argument position (CUDA builds; what cudagraph_trees checks
    static inputs with; checked 2.11, 2.13). The lists it takes are made once per argument count."""
    last = max(indices)
    positions = list(indices)
    by_count: Dict[int, List[Optional[int]]] = {}

    def expected(count: int) -> List[Optional[int]]:
        made: List[Optional[int]] = [None] * count
        for i, ptr in zip(indices, ptrs):
            made[i] = ptr
        return by_count.setdefault(count, made)

    return lambda args: len(args) > last and equal(list(args), by_count.get(len(args)) or expected(len(args)),
                                                   positions)


# The ways AddressCheck can compare here, in the order it prefers them: "compiled" (cgcompile's helper: 0.6 us for
# 118 parameters on this project's CPU machine, where "python" takes 7.5 us; bench_cpu table (g)), "torch" (CUDA
# builds' own: pybind casts per argument, not measured here; bench_gpu prints the two side by side), "python" (one
# data_ptr() call per tensor). ADDRESS_CHECK_IMPL, the first, is what the runtime uses.
ADDRESS_CHECK_IMPLS = tuple(name for name, present in (("compiled", _COMPILED_CHECK is not None),
                                                      ("torch", _DATA_PTRS_EQUAL is not None), ("python", True))
                            if present)
ADDRESS_CHECK_IMPL = ADDRESS_CHECK_IMPLS[0]


class AddressCheck:
    """`matches(args)`: is args[i].data_ptr() == ptrs[k] for each k, i in enumerate(indices)? In one C call where
    one is available (ADDRESS_CHECK_IMPLS), else one pass of map() over the Python method. `impl` picks one of
    ADDRESS_CHECK_IMPLS (tests and benchmarks compare them)."""

    def __init__(self, indices: Sequence[int], ptrs: Sequence[int], impl: str = ADDRESS_CHECK_IMPL):
        if impl not in ADDRESS_CHECK_IMPLS:
            raise ValueError(f"address check {impl!r} is not available here; available: {ADDRESS_CHECK_IMPLS}")
        self.indices = tuple(indices)
        self.ptrs = tuple(ptrs)
        self.matches: Callable[[Sequence[Any]], bool] = self._pick(impl)

    def _pick(self, impl: str) -> Callable[[Sequence[Any]], bool]:
        indices, ptrs = self.indices, self.ptrs
        if not indices:
            return lambda args: True
        if impl == "compiled":
            return _COMPILED_CHECK(indices, ptrs)
        if impl == "torch":
            return by_position_check(_DATA_PTRS_EQUAL, indices, ptrs)
        last = max(indices)  # an argument list too short to hold them all does not match
        expected = list(ptrs)
        return lambda args: len(args) > last and list(map(_DATA_PTR, map(args.__getitem__, indices))) == expected


# copy_all(destinations, sources): destinations[k].copy_(sources[k]) for every k in one dispatch. torch._foreach_copy_
# (semi-private, used by torch.optim; checked 2.11, 2.13), bound as it is: it runs on every replay.
copy_all: Callable[[List[torch.Tensor], Sequence[torch.Tensor]], None] = torch._foreach_copy_

# set_grad_enabled(mode): torch._C._set_grad_enabled (private; what torch.set_grad_enabled's constructor calls and what
# Dynamo graphs call; checked 2.13), without building the context-manager object on every replay.
set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run `callback` when the autograd backward pass now running finishes: the engine's queue_callback
    (torch.autograd.Variable._execution_engine, private; FSDP2 uses it the same way; checked 2.11, 2.13).
    Must be called from inside a backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def storage_weak_ref(t: torch.Tensor) -> Any:
    """A weak reference to t's storage that tells whether anything (t, a view of it, autograd) still holds it:
    `.expired()`. torch.multiprocessing.reductions.StorageWeakRef (what cudagraph_trees tracks outputs with;
    checked 2.11, 2.13)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(t.untyped_storage())


def functorch_level() -> int:
    """How many functorch transforms (vmap, grad, jvp, ...) are active on this thread: 0 outside any.
    torch._C._functorch.maybe_current_level (checked 2.11, 2.13), which returns None outside every transform."""
    level = torch._C._functorch.maybe_current_level()
    return 0 if level is None else int(level)


def pop_functorch_level() -> None:
    """Leave the innermost functorch transform, whatever its kind: the `_<kind>_decrement_nesting` that matches
    torch._C._functorch.peek_interpreter_stack().key() (TransformType Vmap/Grad/Jvp/Functionalize; checked 2.11,
    2.13). Used only to undo levels a trace left open."""
    functorch = torch._C._functorch
    kind = str(functorch.peek_interpreter_stack().key()).rsplit(".", 1)[-1].lower()
    pop = {"vmap": functorch._vmap_decrement_nesting, "grad": functorch._grad_decrement_nesting,
           "jvp": functorch._jvp_decrement_nesting, "functionalize": functorch._func_decrement_nesting}[kind]
    pop()


def resolve_overload(packet: Any, args: Sequence[Any], kwargs: dict) -> Any:
    """The overload of aten `packet` that a call with these (real or fake) arguments dispatches to, or None when
    no schema matches. torch._C._jit_resolve_packet (what OpOverloadPacket.__call__'s schema matching uses;
    checked 2.11, 2.13) returns the overload name."""
    try:
        name = torch._C._jit_resolve_packet(packet._qualified_op_name, *args, **kwargs)
    except Exception:
        return None
    return getattr(packet, name or "default", None)


def compile_id() -> Optional[tuple]:
    """(frame id, compile index) of the Dynamo compile running now (called from a backend), or None outside one:
    every recompile of one code object keeps its frame id and takes the next index.

    torch._guards.CompileContext.current_compile_id() (CompileId.frame_id, .frame_compile_id): private; checked
    2.11, 2.13."""
    try:
        from torch._guards import CompileContext
        found = CompileContext.current_compile_id()
    except (ImportError, AttributeError):
        return None
    frame, index = getattr(found, "frame_id", None), getattr(found, "frame_compile_id", None)
    return None if frame is None or index is None else (frame, index)


def dynamo_frame() -> tuple:
    """(code, locals) of the frame Dynamo is compiling now (called from a backend), or (None, {}) outside one,
    and whether that frame is a resume function Dynamo made after a graph break.

    torch._dynamo.symbolic_convert.InstructionTranslator.current_tx(): private, the same call torch's own
    torch/_dynamo/testing.py backends make; resume functions are named "torch_dynamo_resume_in_<fn>_at_<line>"
    (torch/_dynamo/resume_execution.py). Checked 2.11, 2.13."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return None, {}, False
    code, f_locals = getattr(tx, "f_code", None), getattr(tx, "f_locals", None)
    resume = code is not None and code.co_name.startswith("torch_dynamo_resume_in_")
    return code, (f_locals if isinstance(f_locals, dict) else {}), resume


def graph_input_source(node: Any) -> Optional[str]:
    """The user-level name Dynamo gave a placeholder's value ("L['position_ids']"), or None.

    Dynamo's private `grapharg` node meta (GraphArg.source); Source.name is a method on 2.11 and a property on
    2.13. Checked 2.11, 2.13."""
    source = getattr(getattr(node, "meta", {}).get("grapharg"), "source", None)
    if source is None:
        return None
    try:
        name = source.name
        return name() if callable(name) else name
    except Exception:
        return None


def explain_recorder(backend: Callable) -> Any:
    """A Dynamo backend that records each graph and break reason as torch._dynamo.explain does, then hands the
    graph to `backend`; `.output()` gives the same ExplainOutput. torch._dynamo.backends.debugging's
    ExplainWithBackend (private, used by torch's own tests). Checked 2.11, 2.13."""
    from torch._dynamo.backends.debugging import ExplainWithBackend
    return ExplainWithBackend(backend)

"""The one place cgcompile touches private torch APIs.

Each wrapper names the private API it uses and the torch versions it was checked against (2.13 CPU here,
2.11 on the GPU image). When torch moves one of them, this file is the only one to fix.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = [
    "TorchDispatchMode", "aot_module_simplified", "boxed", "cuda_end_allocate_to_pool", "inductor_compile",
    "storage_id", "storage_use_count",
]

# torch.utils._python_dispatch.TorchDispatchMode: a private module, stable since 1.13; checked 2.11, 2.13.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def aot_module_simplified(mod: torch.fx.GraphModule, args: Sequence[Any], *, fw_compiler: Callable,
                          bw_compiler: Callable, inference_compiler: Callable) -> Callable[..., Any]:
    """torch._functorch.aot_autograd.aot_module_simplified (checked 2.11, 2.13).

    Returns a callable with `mod`'s positional calling convention (the non-boxed one, see its source), whose
    forward/backward/inference graphs are what our compilers returned. It fakifies `args` in a fresh
    FakeTensorMode when no tracing context is active, so calling it at run time with real tensors is fine.
    """
    from torch._functorch.aot_autograd import aot_module_simplified as aot

    return aot(mod, args, fw_compiler=fw_compiler, bw_compiler=bw_compiler, inference_compiler=inference_compiler)


def boxed(fn: Callable[[list], Any]) -> Callable[[list], Any]:
    """Mark `fn(args: list)` as using aot_autograd's boxed calling convention.

    aot's runtime (torch/_functorch/_aot_autograd/utils.py call_func_at_runtime_with_args, checked 2.11, 2.13)
    calls `f(args)` when `f._boxed_call` is true, else `f(*args)` with a deprecation warning.
    """
    fn._boxed_call = True  # type: ignore[attr-defined]
    return fn


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, is_backward: bool,
                     is_inference: bool) -> Callable[[list], Any]:
    """Inductor-compile one aot graph: torch._inductor.compile_fx.compile_fx_inner (checked 2.13).

    Inductor's own cudagraphs stay off (its `cudagraphs` kwarg defaults to None = off): we capture the
    result ourselves. The returned object is boxed (it takes one list, and may clear it).
    """
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, is_backward=is_backward, is_inference=is_inference)


def storage_id(t: torch.Tensor) -> int:
    """A handle on t's StorageImpl for storage_use_count: UntypedStorage._cdata (checked 2.11, 2.13).

    Valid only while something keeps the storage alive (the runtime holds a tensor on it).
    """
    return t.untyped_storage()._cdata


def storage_use_count(sid: int) -> int:
    """How many tensors (and Python storage objects) hold the storage: torch._C._storage_Use_Count.

    Used by torch/_inductor/cudagraph_trees.py the same way (checked 2.11, 2.13). Counting storage owners,
    not Python references to one tensor object, makes views, `.detach()` aliases and autograd's C++
    SavedVariables all visible.
    """
    return torch._C._storage_Use_Count(sid)


def cuda_end_allocate_to_pool(device: torch.device, pool: Any) -> None:
    """After a failed capture, stop routing allocations to the graph's pool.

    CUDAGraph::capture_end (aten/src/ATen/cuda/CUDAGraph.cpp, 2.11/2.13) raises on cudaStreamEndCapture's
    error *before* calling endAllocateToPool, leaving the pool marked as capturing. torch._C._cuda_endAllocateToPool
    (torch/cuda/memory.py uses it) ends that; best effort, never raises.
    """
    try:
        torch._C._cuda_endAllocateToPool(device.index if device.index is not None else torch.cuda.current_device(),
                                         tuple(pool))
    except Exception:
        pass

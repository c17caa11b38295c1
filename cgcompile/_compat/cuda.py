"""Private CUDA APIs around graph capture: the graph memory pool after a failed capture, and how each torch release
treats random-number generators inside a capture. Re-exported by cgcompile._compat."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["UNREGISTERED_GENERATOR_MESSAGES", "cuda_end_allocate_to_pool", "cuda_release_pool",
           "generator_capture_state_outlives_failure", "is_unregistered_generator_error"]


def cuda_end_allocate_to_pool(device: torch.device, pool: Any) -> bool:
    """After a failed capture, stop routing allocations to the graph's pool; True if a recording was ended.

    CUDAGraph::capture_end (aten/src/ATen/cuda/CUDAGraph.cpp, 2.11/2.13) raises on cudaStreamEndCapture's
    error *before* calling endAllocateToPool, leaving the pool marked as capturing.
    torch._C._cuda_endAllocateToPool (torch/cuda/memory.py and _inductor/cudagraph_trees.py use it) ends that;
    it raises when the pool is not recording (capture_end did end it), which we report as False.
    """
    try:
        torch._C._cuda_endAllocateToPool(_index(device), tuple(pool))
        return True
    except Exception:
        return False


def cuda_release_pool(device: torch.device, pool: Any) -> None:
    """Drop the reference CUDAGraph::capture_begin took on the pool (beginAllocateToPool increfs it; only the
    graph's reset() would release it, and a graph whose capture failed never does): torch._C._cuda_releasePool,
    paired with _cuda_endAllocateToPool the same way in torch/cuda/memory.py (checked 2.11, 2.13). Best effort."""
    try:
        torch._C._cuda_releasePool(_index(device), tuple(pool))
    except Exception:
        pass


# --- CUDA generators in captures (read in each release's CUDA build: aten/src/ATen/cuda/CUDAGeneratorImpl.h and the
# messages of libtorch_cuda.so of torch 2.11.0, 2.12.0 and 2.13.0 for CUDA 13.0) -------------------------------------
# 2.11: a generator's state has one `capturing_` flag, set when a capture begins (CUDAGraph::capture_begin registers
#   the current device's default generator and calls its capture_prologue) and cleared by capture_epilogue, which
#   capture_end reaches only after cudaStreamEndCapture succeeded. A capture that fails inside CUDA (a sync op
#   invalidated it) leaves the flag set: every later eager draw from that generator raises "Offset increment outside
#   graph capture encountered unexpectedly." until some capture on that device completes. A generator that was not
#   registered raises "Attempt to increase offset for a CUDA generator not in capture mode." when drawn from
#   inside a capture.
# 2.12, 2.13: per-capture state keyed by capture id (CUDAGeneratorCaptureState): nothing outlives a failed capture.
#   The default generator is still registered by capture_begin; any other generator must be registered with
#   CUDAGraph.register_generator_state before capture_begin, else drawing from it during capture raises "RNG op
#   during graph capture but generator is not registered with the capturing graph." Lazy registration of other
#   generators is not in these releases.
UNREGISTERED_GENERATOR_MESSAGES = ("generator is not registered with the capturing graph",  # 2.12, 2.13
                                   "Attempt to increase offset for a CUDA generator not in capture mode")  # 2.11


def generator_capture_state_outlives_failure(version: Any = None) -> bool:
    """Does a capture that failed inside CUDA leave the device's default generator in capture mode (torch < 2.12,
    see above)? `version` defaults to the running torch."""
    return torch.torch_version.TorchVersion(str(version or torch.__version__)) < (2, 12)


def is_unregistered_generator_error(message: str) -> bool:
    """Is this capture failure a draw from a generator the capture did not register (a torch.Generator of the
    user's own; both wordings above)?"""
    return any(text in message for text in UNREGISTERED_GENERATOR_MESSAGES)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()

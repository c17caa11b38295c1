"""bench_cpu table (j): kernels launched per step, cgcompile against whole-graph Inductor, counted on the CPU.

Why: where reduce-overhead works, a step's GPU time is its kernels; a partitioned capture that loses fusions at
its boundaries, leaves glue ops eager or copies inputs into static buffers launches more of them. On the CPU the
kernels are counted from torch.profiler events (the launch count a GPU run would make, without a GPU):

- an Inductor-generated C++ kernel is one event when `torch._inductor.config.cpp.enable_kernel_profile` is on
  (named `graph_<id>_cpp_fused_...`); an extern kernel (mm, bmm) and every aten op run outside a graph (copies
  into static buffers, eager islands, output clones, the loss's backward seed) are aten events;
- one kernel per innermost kernel-running event: `aten::linear` is counted as its `aten::addmm` (whose copy of
  the bias into its output is part of it: GEMM_WITH_INPUT), views, metadata and allocations
  (cgcompile.profiling's NO_KERNEL_OPS, and `resize_`) as nothing;
- a `_foreach_` op is one kernel (CUDA's multi-tensor kernel), except a `_foreach_copy_` that CUDA would copy
  tensor by tensor (lists of mixed dtypes, pairs of different strides: cuda_launches), one kernel per tensor;
- inside an emulated replay (cgcompile::graph_replay) only the graph's own ops count, those run under the
  emulator's dispatch mode (`aten::mm < PythonDispatchMode < aten::mm`: the inner one) and Inductor's kernels;
  the emulator's own work there (copying fresh outputs into the static ones, poisoning later graphs' memory)
  launches nothing on a GPU.

Variants: torch.compile's default (Inductor over the whole graph), cgcompile with inner_compiler="inductor" and
"eager" (driver=emulate, default options). Workloads: HF Llama and HF Mixtral (tiny, from configs: 2 layers, hidden
32) bf16 training steps (forward with labels, loss, backward, grads to None; new tokens every step; Llama also with
use_cache=False, as training code passes it: no key/value tensors leave the frame), and the
KV-cache decode step of tests/models/kv_gpt.py (2 layers, batch 4, a new position every step, block scope);
`--workloads decode-layer`: the same step in layer scope (one graph per layer, the glue between them eager).
"""

from __future__ import annotations

import collections
import os
import re
import sys
from typing import Callable, Counter, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.models, tests.hf
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # hf_moe

import torch  # noqa: E402

from cgcompile.profiling import NO_KERNEL_OPS  # noqa: E402
from goals import judged  # noqa: E402
from cgcompile.runtime.drivers.emulate import REPLAY_RANGE  # noqa: E402

__all__ = ["GOAL", "VARIANTS", "WORKLOADS", "count_kernels", "diff_rows", "kernel_events", "kernels_per_step",
           "workload"]

GOAL = 1.05  # cgcompile-inductor kernels per step vs whole-graph Inductor's
VARIANTS = ("inductor", "cg-inductor", "cg-eager")
WORKLOADS = ("llama-train", "llama-train-no-cache", "mixtral-train", "decode")
OTHER_WORKLOADS = ("decode-layer",)  # named with --workloads; not in table (j)
INDUCTOR_KERNEL = re.compile(r"^(graph_\d+_)?cpp_")  # enable_kernel_profile's event names
# ops that run no kernel of their own besides what their children run (`to` without a copy, a dtype's promotion)
FREE = NO_KERNEL_OPS | {"aten::resize_", "aten::set_", "aten::as_strided_", "aten::to", "aten::_to_copy",
                        "aten::result_type", "aten::detach_", "aten::_unsafe_view"}
MODE = "PythonDispatchMode"
# GEMMs with an additive input (`linear`'s bias): on the CPU they copy it into the output (an `aten::copy_` child)
# and call BLAS, which is no aten op, so the copy would be their innermost kernel; they are counted as themselves
# (on CUDA one cuBLAS kernel reads the bias), their copy as part of them
GEMM_WITH_INPUT = {"aten::addmm", "aten::addbmm", "aten::baddbmm", "aten::addmv", "aten::addr"}


def _kernel_running(name: str) -> bool:
    return bool(INDUCTOR_KERNEL.match(name)) or (name.startswith("aten::") and name not in FREE)


def _kernel(event) -> bool:
    """Does this event run a kernel of its own (a GEMM's copy of its additive input is the GEMM's)?"""
    parent = event.cpu_parent
    return _kernel_running(event.name) and not (
        event.name == "aten::copy_" and parent is not None and parent.name in GEMM_WITH_INPUT)


def _key(name: str) -> str:
    """The diff table's row: aten ops by name, Inductor's generated kernels by their fused name."""
    return "inductor " + re.sub(r"^graph_\d+_", "", name) if INDUCTOR_KERNEL.match(name) else name


def _foreach(name: str) -> bool:
    """A `_foreach_` op is one multi-tensor kernel on CUDA (per chunk of tensors), however many tensors: counted
    once (but see cuda_launches), its per-tensor children on the CPU not at all."""
    return name.startswith("aten::_foreach_")


def cuda_launches(event) -> int:
    """Kernels CUDA launches for this kernel event: 1, except for a `_foreach_copy_` that CUDA's multi-tensor
    route refuses (its destinations of more than one dtype, or its sources, or a pair differing in size or
    stride: `foreach_tensor_copy_list_kernel_cuda_` then copies tensor by tensor), one per tensor. Read from the
    per-tensor `copy_` children the CPU runs (their dtypes, shapes and strides: profile with record_shapes; torch
    2.11's profiler records neither dtypes nor strides, so there a foreach is judged by its sizes alone)."""
    if event.name != "aten::_foreach_copy_":
        return 1
    pairs = [child for child in getattr(event, "cpu_children", ()) if child.name == "aten::copy_"]
    if len(pairs) < 2:
        return 1
    dtypes = [tuple((getattr(child, "input_dtypes", None) or [None, None])[:2]) for child in pairs]
    if not all(dtypes[0][0] == dst and dtypes[0][1] == src for dst, src in dtypes):
        return len(pairs)
    strides = [getattr(child, "structured_input_strides", None) or [None, None] for child in pairs]
    same = all(child.input_shapes[0] == child.input_shapes[1] and stride[0] == stride[1]
               for child, stride in zip(pairs, strides))
    return 1 if same else len(pairs)


def kernel_events(events: Iterable) -> Iterator[Tuple[str, str, object]]:
    """(where, op, event) for each kernel among torch.profiler events (anything with .name and .cpu_parent):
    `where` is "graph" for kernels of a replayed graph, "host" for those launched one by one. The rules: the
    module docstring. The event is handed out so that a caller can read its time (gpu_kernels.py)."""
    events = list(events)
    has_kernel_child = set()
    for event in events:
        if _kernel(event):
            parent = event.cpu_parent
            while parent is not None:
                has_kernel_child.add(id(parent))
                parent = parent.cpu_parent
    for event in events:
        names, parent = [], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        if not _kernel(event) or any(map(_foreach, names)) or (
                id(event) in has_kernel_child and not _foreach(event.name)):
            continue
        if REPLAY_RANGE in names:
            inside = names[:names.index(REPLAY_RANGE)]
            if MODE not in inside and not INDUCTOR_KERNEL.match(event.name):
                continue  # the emulator's own copies and poison: nothing a GPU graph launches
            yield "graph", _key(event.name), event
        else:
            yield "host", _key(event.name), event


def count_kernels(events: Iterable) -> Counter:
    """{(where, op): kernels} over torch.profiler events (see kernel_events and cuda_launches)."""
    found: Counter = collections.Counter()
    for where, op, event in kernel_events(events):
        found[(where, op)] += cuda_launches(event)
    return found


# --- workloads -------------------------------------------------------------------------------------------------


def workload(name: str, layers: int = 2) -> Tuple[torch.nn.Module, Callable[[Callable], Callable[[], None]], dict]:
    """(model, make_step(fn) -> step(), cgcompile options besides driver and inner_compiler) for `name`."""
    if name in ("decode", *OTHER_WORKLOADS):
        from tests.models import kv_gpt

        model = kv_gpt.build(num_layers=layers).eval()
        (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
        positions = kv_gpt.positions(model.max_seq)
        with torch.no_grad():
            first = kv_gpt.prefill(model, prompt)
        state = {"i": 0}

        def make_decode(fn):
            def step():  # a real decode loop: a new position (and token) every step, wrapping in the cache
                position = positions[8 + state["i"] % (model.max_seq - 8)]
                state["i"] += 1
                with torch.no_grad():
                    fn(first, position)
            return step
        # block scope: the whole step one graph (layer scope leaves the embeddings, mask, final norm, head and
        # argmax eager between the layers' graphs: 7 kernels launched one by one, which whole-graph Inductor fuses)
        scope = "layer" if name == "decode-layer" else "block"
        return kv_gpt.DecodeStep(model), make_decode, {"cuda_graph_modules": ["attn", "mlp"],
                                                       "inference_cuda_graph_scope": scope}
    if name.startswith("llama-train"):
        from tests.hf.families import build

        model = build("llama", layers=layers).to(torch.bfloat16).train()
    elif name == "mixtral-train":
        import hf_moe

        model = hf_moe.build(layers=layers, dtype=torch.bfloat16)
    else:
        raise ValueError(f"unknown workload {name!r}; workloads: {WORKLOADS + OTHER_WORKLOADS}")
    generator = torch.Generator().manual_seed(1000)
    batches = [torch.randint(0, 64, (2, 16), generator=generator) for _ in range(8)]
    state = {"i": 0}

    cache = {"use_cache": False} if name.endswith("no-cache") else {}  # no key/value outputs to hand out

    def make_train(fn):
        def step():
            ids = batches[state["i"] % len(batches)]
            state["i"] += 1
            fn(input_ids=ids, labels=ids, **cache).loss.backward()
            model.zero_grad(set_to_none=True)
        return step
    return model, make_train, {}


def compiled(model: torch.nn.Module, variant: str, options: dict) -> Callable:
    if variant == "inductor":
        return torch.compile(model)
    if variant == "eager":  # Dynamo's eager backend: the --quick stand-in for whole-graph Inductor (no C++ compile)
        return torch.compile(model, backend="eager")
    inner = variant.split("-", 1)[1]
    return torch.compile(model, backend="cudagraph_modules",
                         options={**options, "driver": "emulate", "inner_compiler": inner})


def kernels_per_step(name: str, variant: str, warmup: int = 6, steps: int = 2, layers: int = 2) -> Counter:
    """{(where, op): kernels per step} of `variant` on workload `name`, after `warmup` steps (capture included)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        module, make_step, options = workload(name, layers)
        step = make_step(compiled(module, variant, options))
        for _ in range(warmup):
            step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                step()
    found = count_kernels(prof.events())
    return collections.Counter({key: count / steps for key, count in found.items()})


def diff_rows(counts: Dict[str, Counter], base: str, ours: str) -> List[Tuple[str, Dict[str, float]]]:
    """Per op whose count per step differs between the variants: (op, {variant: count}), `ours`' largest excess
    over `base` first. Inductor's kernels are one row (their fusions differ by name, not kind)."""
    merged: Dict[str, Counter] = {}
    for variant, found in counts.items():
        merged[variant] = collections.Counter()
        for (where, op), n in found.items():
            merged[variant]["inductor kernels" if op.startswith("inductor ") else op] += n
    keys = set().union(*(set(c) for c in merged.values()))
    rows = [(op, {v: merged[v][op] for v in merged}) for op in keys]
    rows = [r for r in rows if any(abs(n - r[1].get(base, 0)) > 1e-9 for n in r[1].values())]
    return sorted(rows, key=lambda r: (-(r[1].get(ours, 0) - r[1].get(base, 0)), r[0]))


def totals(found: Counter) -> Tuple[float, float]:
    """(kernels per step, of which launched one by one outside graphs)."""
    return sum(found.values()), sum(n for (where, _), n in found.items() if where == "host")


def table(workloads: Sequence[str], variants: Sequence[str] = VARIANTS, base: str = "inductor",
          ours: Optional[str] = "cg-inductor", layers: int = 2, warmup: int = 6, steps: int = 2,
          emit: Callable[[str], None] = print) -> Dict[str, Dict[str, Counter]]:
    """Print table (j): per workload, kernels per step per variant with the ratio to `base`, the verdict for
    `ours` (GOAL), and the per-op diff naming where each extra kernel comes from."""
    results: Dict[str, Dict[str, Counter]] = {}
    for name in workloads:
        counts = {v: kernels_per_step(name, v, warmup=warmup, steps=steps, layers=layers) for v in variants}
        results[name] = counts
        base_total = totals(counts[base])[0]
        emit(f"  {name}:")
        for variant in variants:
            total, host = totals(counts[variant])
            ratio = total / base_total if base_total else float("nan")
            verdict = ""
            if variant == ours:
                verdict = f"  goal <= {GOAL:.2f}x  {judged(ratio, GOAL)}"
            emit(f"    {variant:<12} {total:6.1f} kernels/step ({host:5.1f} outside graphs)  {ratio:5.2f}x "
                 f"vs {base}{verdict}")
        mine = ours or variants[-1]
        rows = diff_rows(counts, base, mine)
        if rows:
            emit(f"    per-op difference, kernels per step {'/'.join(variants)}: "
                 + ", ".join(f"{op} " + "/".join(f"{c[v]:g}" for v in variants) for op, c in rows))
        outside = sorted((n, op) for (where, op), n in counts[mine].items() if where == "host")
        emit(f"    {mine} outside graphs: " + ", ".join(f"{op} {n:g}" for n, op in reversed(outside)))
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = args.variants.split(",")  # the baseline: whole-graph Inductor when it runs, else the first named
    table(args.workloads.split(","), chosen, base="inductor" if "inductor" in chosen else chosen[0],
          ours="cg-inductor" if "cg-inductor" in chosen else None, layers=args.layers)

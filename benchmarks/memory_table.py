"""Table (i): what captured graphs hold beyond eager, by kind (stats()["graph_memory"]), on HF Llama and HF
Mixtral training (CPU, fp32, emulate driver, tiny configs built in code), against what eager holds for the same
step: its saved activations (the tensors autograd keeps between forward and backward, parameters left out).

Graphs keep their static memory between steps; eager's activations live only between a step's forward and
backward. Equal numbers mean the graphs hold about one step's activations for good; the rest is what the runtime
adds (input buffers copied in, outputs kept as static memory that eager would free at once).

Beside it (not with --quick): a frame Dynamo compiled again with dynamic sizes, the graphs of the frame it
superseded released (runtime/local/lineage.py), and what they held.

Run: python benchmarks/memory_table.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # goals

import cgcompile  # noqa: E402
from goals import judged  # noqa: E402

KINDS = ("static_inputs", "saved_for_backward", "gradients", "other_outputs", "arenas", "pool", "total")


def saved_activation_bytes(model: torch.nn.Module, ids: torch.Tensor) -> Tuple[int, int]:
    """Bytes of the distinct storages autograd saves for backward in one eager training step (parameters out),
    and of the gradients it leaves (.grad)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(storages.values()), sum(p.grad.untyped_storage().nbytes() for p in model.parameters()
                                       if p.grad is not None)


def graph_memory(family: str, steps: int) -> Tuple[Dict[str, int], Tuple[int, int]]:
    """stats()["graph_memory"] after `steps` SGD steps of the compiled model, and eager's saved activations."""
    from tests.hf.families import build, tokens  # transformers: a test dependency

    torch._dynamo.reset()
    model = build(family)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "cuda_graph_modules": [], "cuda_graph_warmup_steps": 2})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cgcompile.reset_stats()
    for step in range(steps):
        ids = tokens(step)
        compiled(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    held = dict(cgcompile.stats()["graph_memory"])
    eager = saved_activation_bytes(reference, tokens(0))
    del compiled, model
    torch._dynamo.reset()
    return held, eager


def rows(quick: bool) -> List[Tuple[str, Dict[str, int], Tuple[int, int]]]:
    steps = 4 if quick else 6
    return [(family, *graph_memory(family, steps)) for family in (("llama",) if quick else ("llama", "mixtral"))]


def print_memory_table(quick: bool) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("\n(i) what the graphs hold: skipped (transformers is not installed)")
        return
    print("\n(i) what the graphs hold (stats()['graph_memory'], KiB) vs what eager holds for the same step (saved "
          "activations between forward and backward, gradients after it), HF tiny configs, fp32, emulate driver; "
          "beyond eager = total - saved_for_backward - gradients, goal: total <= 1.3x eager's saved + gradients")
    print("  " + "  ".join(f"{h:>13}" for h in ("model",) + KINDS + ("eager saved", "eager grads", "ratio", "result")))
    for family, held, (saved, grads) in rows(quick):
        ratio = held["total"] / (saved + grads)
        cells = [family] + [f"{held[k] / 1024:.1f}" for k in KINDS] + [
            f"{saved / 1024:.1f}", f"{grads / 1024:.1f}", f"{ratio:.2f}x", judged(ratio, 1.3)]
        print("  " + "  ".join(f"{c:>13}" for c in cells))


def recompiled_frame(family: str) -> Dict[str, float]:
    """HF `family` trained at one sequence length, then at two others (Dynamo compiles the forward again with the
    length symbolic): the first frame's graphs and bytes before the change, and at the end the graphs released and
    what the live graphs hold (without the release the first frame's graphs would still hold their bytes)."""
    from tests.hf.families import build  # transformers: a test dependency

    torch._dynamo.reset()
    model = build(family)
    compiled = torch.compile(model, backend="cudagraph_modules",
                             options={"driver": "emulate", "cuda_graph_modules": [], "cuda_graph_warmup_steps": 1})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    cgcompile.reset_stats()
    first: Dict[str, float] = {}
    for step, length in enumerate([16] * 3 + [12, 20] * 4 + [16] * 4):
        if step == 3:
            st = cgcompile.stats()
            first = {"graphs": len(st["graphs"]), "bytes": st["graph_bytes"]}
        ids = torch.randint(0, 64, (2, length), generator=generator)
        compiled(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    st = cgcompile.stats()
    del compiled, model
    torch._dynamo.reset()
    return {"first graphs": first["graphs"], "first bytes": first["bytes"], "released": st["graphs_released"],
            "live": len(st["graphs"]), "live bytes": st["graph_bytes"]}


def print_recompiled_frames() -> None:
    print("\n(i) a frame Dynamo compiled again with dynamic sizes (runtime/local/lineage.py): HF tiny configs, fp32, "
          "sequence length 16 for 3 steps, then 12 and 20 in turn, then 16; KiB")
    print("  " + "  ".join(f"{h:>14}" for h in ("model", "first frame", "its KiB", "released *", "live graphs",
                                                 "live KiB", "without release")))
    for family in ("llama", "mixtral"):
        row = recompiled_frame(family)
        cells = [family, row["first graphs"], f"{row['first bytes'] / 1024:.1f}", row["released"], row["live"],
                 f"{row['live bytes'] / 1024:.1f}", f"{(row['live bytes'] + row['first bytes']) / 1024:.1f}"]
        print("  " + "  ".join(f"{c:>14}" for c in cells))
    print("  * stats()['graphs_released']: instances, a forward with its backward counting one")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args(argv).quick
    print_memory_table(quick)
    if not quick:
        print_recompiled_frames()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Instructions per decode step, counted by callgrind: the lean step's candidates (replay_cost.decode_candidates:
Dynamo's floor, the minimal copying backend, cgcompile per scope) in one process, each candidate's steps counted
apart, replays as launches.

A count of executed instructions does not move with the machine's load as a time does (the lean-step row's ratios
moved by 0.1-0.5x between runs of the same code on a shared 2-core VM), so it shows what a change to the step's
host path removes. It is not the goal's measure: a step's time also depends on what each instruction costs, and
an interpreted Python call's instructions run several times slower than Dynamo's guard checks in C++.

    python benchmarks/step_instructions.py [--layers 8] [--steps 20] [--keep DIR]

runs itself under valgrind (valgrind on PATH; a few minutes): instrumentation off while it compiles and warms up,
switched on (callgrind_control) once every candidate is steady, each candidate's steps collected into a dump of
their own, whose total is read back. `--child --no-valgrind` runs the candidates without counting (tests).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for benchmarks.replay_cost and tests.models
SCOPES = ("layer", "block")


def child(layers: int, steps: int, warmup: int, counting: bool) -> None:
    """Run every candidate steady, then `steps` steps of each with collection on; print one JSON line per
    candidate, in the order of the dumps: its name and the steady replays (cgcompile's short path) per step."""
    import torch

    import cgcompile
    from benchmarks.replay_cost import collector_paused, decode_candidates, replays_as_launches

    torch.set_num_threads(1)
    names, run = decode_candidates(SCOPES, layers)
    with torch.no_grad():
        for name in names:
            run(name, warmup)
        if counting:
            subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True, capture_output=True)
        with replays_as_launches(), collector_paused():
            for name in names:
                run(name, 5)  # the first steps after instrumentation starts run code valgrind translates anew
                before = cgcompile.stats()["steady_replays"]
                torch._C._valgrind_toggle()
                run(name, steps)
                torch._C._valgrind_toggle_and_dump_stats()
                steady = cgcompile.stats()["steady_replays"] - before
                print(json.dumps({"name": name, "steady_per_step": steady / steps}), flush=True)


def totals(out_dir: pathlib.Path, pid: int, count: int) -> List[int]:
    """The instruction totals of the child's dumps 1..count (callgrind numbers a process's dumps in order)."""
    found = []
    for k in range(1, count + 1):
        dump = out_dir / f"cg.{pid}.{k}"
        m = re.search(r"^(?:totals|summary): (\d+)", dump.read_text(), re.M)
        if m is None or m[1] == "0":  # no count rather than a count of zero (instrumentation never on: a 0 total)
            raise SystemExit(f"{dump} holds no instructions counted")
        found.append(int(m[1]))
    return found


def measure(layers: int, steps: int, warmup: int, keep: Optional[str] = None) -> Dict[str, dict]:
    """Run the child under callgrind; per candidate: instructions per step and steady replays per step. `keep`: a
    directory to leave the dumps in (cg.<pid>.<k>, the k-th candidate's), for callgrind_annotate."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("step_instructions.py needs valgrind (with callgrind_control) on PATH")
    out_dir = pathlib.Path(keep) if keep else pathlib.Path(tempfile.mkdtemp(prefix="cg-steps-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
         f"--callgrind-out-file={out_dir}/cg.%p", sys.executable, __file__, "--child",
         "--layers", str(layers), "--steps", str(steps), "--warmup", str(warmup)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the counted run failed ({proc.returncode}):\n{stderr[-3000:]}")
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    counted = totals(out_dir, proc.pid, len(rows))
    if not keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {row["name"]: {"per_step": total / steps, "steady_per_step": row["steady_per_step"]}
            for row, total in zip(rows, counted)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=200, help="steps each candidate runs before counting")
    parser.add_argument("--keep", metavar="DIR", help="leave the callgrind dumps in DIR (for callgrind_annotate)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-valgrind", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.layers, args.steps, args.warmup, counting=not args.no_valgrind)
        return
    rows = measure(args.layers, args.steps, args.warmup, args.keep)
    floor, minimal = rows["floor"]["per_step"], rows["minimal"]["per_step"]
    print(f"instructions per decode step ({args.layers} layers, callgrind, {args.steps} counted steps per candidate, "
          f"replays as launches; not the lean-step goal's measure, which is time)")
    for name, row in rows.items():
        steady = "" if name not in SCOPES else f"   steady replays per step {row['steady_per_step']:.2f}"
        print(f"  {name:12s} {row['per_step']:10,.0f}   {row['per_step'] / floor:5.3f}x the floor   "
              f"{row['per_step'] - minimal:+9,.0f} vs minimal{steady}")


if __name__ == "__main__":
    main()

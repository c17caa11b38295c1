"""Spawn test workers as separate processes on gloo over loopback, time-bounded, results back as JSON.

A test module that runs ranks is also the worker script: run as `python <file> RANK WORLD PORT OUT_DIR`, its
`__main__` calls `init_gloo(...)`, does its work and writes `OUT_DIR/rank<RANK>.json` with `write_result`.
`run_ranks` starts the workers, kills them all at the deadline or as soon as one fails (its peer would block in
a collective), and fails the test with every worker's output.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """In a worker: the default process group on gloo, the repo importable."""
    import torch.distributed as dist

    sys.path.insert(0, REPO)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def write_result(out_dir: str, rank: int, result: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)


def run_ranks(script: str, out, world: int, timeout_s: float, name: str) -> list:
    """Run `script` as `world` workers writing into the directory `out`; [result of rank 0, ...]."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONPATH=REPO)
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's transport on loopback
    port = free_port()
    logs = [open(os.path.join(out, f"rank{rank}.log"), "w+") for rank in range(world)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(script), str(rank), str(world), str(port), str(out)],
                              cwd=REPO, env=env, stdout=logs[rank], stderr=subprocess.STDOUT)
             for rank in range(world)]
    deadline = time.monotonic() + timeout_s
    # Wait for all; a worker that fails leaves its peer blocked in a collective, so stop the rest at once.
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        if any(proc.poll() for proc in procs):
            break
        time.sleep(0.1)
    hung = any(proc.poll() is None for proc in procs) and not any(proc.poll() for proc in procs)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = []
    for rank, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- rank {rank} (exit {procs[rank].returncode}) ---\n" + log.read()[-6000:])
        log.close()
    if hung:
        pytest.fail(f"{name} workers did not finish within {timeout_s}s:\n" + "\n".join(text))
    if any(proc.returncode for proc in procs):
        pytest.fail(f"{name} workers failed:\n" + "\n".join(text))
    with_results = []
    for rank in range(world):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            with_results.append(json.load(f))
    return with_results


def capture_counters() -> dict:
    """In a worker: the cgcompile counters the data-parallel tests assert on, JSON-able."""
    import cgcompile

    s = cgcompile.stats()
    return {"graphs_captured": s["graphs_captured"], "replays": s["replays"], "recaptures": len(s["recaptures"]),
            "recapture_reasons": sorted({r["reason"] for r in s["recaptures"]}),
            "eager_fallbacks": s["eager_fallbacks"]}

"""Spawn test workers as separate processes on gloo over loopback, time-bounded, results back as JSON.

A test module that runs ranks is also the worker script: run as `python <file> RANK WORLD PORT OUT_DIR`, its
`__main__` calls `serve(work, timeout_s)`, which joins the gloo group (`init_gloo`), runs `work(rank, world)` and
writes the dict it returns to `OUT_DIR/rank<RANK>.json` (`write_result`).
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
import traceback
import warnings
from datetime import timedelta
from typing import Callable, Optional, Tuple

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
    print(f"rank {rank}: result written", file=sys.stderr, flush=True)  # a crash after this is in the teardown


def serve(work: Callable[[int, int], dict], timeout_s: float) -> None:
    """In a worker run as `python <file> RANK WORLD PORT OUT_DIR`: `work(rank, world)`'s JSON-able result written
    for `run_ranks`. One frame for every distributed test's worker: the group is destroyed even when the work
    raises (the peer is not left blocked on it), and the traceback is printed before that teardown, which gloo's
    threads may abort, losing an exception printed only at exit."""
    import torch.distributed as dist

    rank, world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    init_gloo(rank, world, port, timeout_s)
    try:
        result = work(rank, world)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        raise SystemExit(1)  # printed already: exit as an uncaught exception does, without printing it twice
    finally:
        dist.destroy_process_group()
    write_result(out_dir, rank, result)


def run_ranks(script: str, out, world: int, timeout_s: float, name: str) -> list:
    """Run `script` as `world` workers writing into the directory `out`; [result of rank 0, ...].

    Workers that a signal ended (gloo's threads aborting the process: "terminate called without an active
    exception", seen now and then under a loaded machine) or whose port was taken are started once more, the
    first attempt's output kept as a warning; a worker that fails with a Python error fails the test at once."""
    failure = _run_ranks_once(script, out, world, timeout_s)
    if failure is not None and (failure[0] == "signal" or "Address already in use" in failure[1]):
        # a signal: see above; the port: free_port() released it and another test's workers (pytest-xdist runs
        # two test files at once) took it before this rank 0 bound it
        warnings.warn(f"{name} workers ended by a signal or lost their port; started once more. Their output:\n"
                      f"{failure[1]}")
        failure = _run_ranks_once(script, out, world, timeout_s)
    if failure is not None:
        kind, text = failure
        pytest.fail(f"{name} workers {'did not finish within ' + str(timeout_s) + 's' if kind == 'hung' else 'failed'}:"
                    f"\n{text}")
    with_results = []
    for rank in range(world):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            with_results.append(json.load(f))
    return with_results


def _run_ranks_once(script: str, out, world: int, timeout_s: float) -> Optional[Tuple[str, str]]:
    """One run of the workers: None, or (how it failed: "hung", "signal" or "error", every worker's output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONPATH=REPO)
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's transport on loopback
    for rank in range(world):  # a result left by an earlier attempt is not this one's
        if os.path.exists(os.path.join(out, f"rank{rank}.json")):
            os.remove(os.path.join(out, f"rank{rank}.json"))
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
    stopped = {rank for rank, proc in enumerate(procs) if proc.poll() is None}  # killed here, not failed
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = []
    for rank, log in enumerate(logs):
        log.seek(0)
        written = os.path.exists(os.path.join(out, f"rank{rank}.json"))
        text.append(f"--- rank {rank} (exit {procs[rank].returncode}, result {'written' if written else 'absent'}) "
                    f"---\n" + log.read()[-6000:])
        log.close()
    if hung:
        return "hung", "\n".join(text)
    failed = [proc.returncode for rank, proc in enumerate(procs) if proc.returncode and rank not in stopped]
    if not failed:
        return None
    return ("signal" if all(code < 0 for code in failed) else "error"), "\n".join(text)


def capture_counters() -> dict:
    """In a worker: the cgcompile counters the data-parallel tests assert on, JSON-able."""
    import cgcompile

    s = cgcompile.stats()
    return {"graphs_captured": s["graphs_captured"], "replays": s["replays"], "recaptures": len(s["recaptures"]),
            "recapture_reasons": sorted({r["reason"] for r in s["recaptures"]}),
            "eager_fallbacks": s["eager_fallbacks"]}

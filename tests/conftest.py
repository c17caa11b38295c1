"""Shared test setup: one intra-op thread per test process, the repo root on sys.path (for tests.models), a clean
Dynamo cache per test, and a check that no test leaves thread-local state (grad mode, autocast, functorch levels,
default dtype) changed."""

import os
import sys

import pytest

# The models here are tiny: intra-op threads buy nothing, and on a 2-core machine the OpenMP pools of two xdist
# workers (and of the ranks a distributed test spawns) spin against each other: two test files run side by side
# took 110 s with torch's default pools and 52 s with one thread each. Set before torch starts its pool; a value
# the caller sets is kept.
_THREADS_GIVEN = "OMP_NUM_THREADS" in os.environ
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

if not _THREADS_GIVEN:
    torch.set_num_threads(1)  # in case a plugin imported torch before this file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    from cgcompile.runtime.drivers.thread_state import GlobalState
    torch._dynamo.reset()
    before = GlobalState.now()
    yield
    torch._dynamo.reset()
    assert GlobalState.now() == before, "the test left global state changed"


# The ten files that take longest (about 35-140 s each of a 2-process run here, measured with --durations=0),
# longest first. xdist's loadfile scheduling hands files out in collection order as workers free up, so a long file
# collected late runs alone at the end while the other worker idles; started first, the short files fill in around
# them (a 2-process run here: 765 s for 1444 s of tests; 794-906 s in the runs before it, some with other load).
LONGEST_FIRST = ("test_random_models.py", "test_benchmarks_gpu.py", "test_benchmarks.py", "test_examples.py",
                 "test_dynamic_padding.py", "hf/test_hf_train.py", "test_tensor_parallel.py", "test_inductor_inner.py",
                 "test_graph_economy_distributed.py", "test_runtime_traps_zoo.py")


def _start_rank(item) -> int:
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_rank)  # stable: each file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def python_host_path(monkeypatch):
    """Models compiled in the test run the host path in Python (cgcompile/native.py's switch): the compiled steady
    replay and scope gate left out, as where they were not built; for tests that follow that path call by call."""
    from cgcompile import native

    monkeypatch.setenv(native.PYTHON_HOST_PATH, "1")

"""Shared test setup: one intra-op thread per test process, the repo root on sys.path (for tests.models), a clean
Dynamo cache and zeroed cgcompile.stats() counters per test, and a check that no test leaves thread-local state (grad mode, autocast, functorch levels,
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
    from cgcompile import reset_stats
    from cgcompile.runtime.drivers.thread_state import GlobalState
    torch._dynamo.reset()
    reset_stats()  # a test's counts are its own (the graphs another test left are released with Dynamo's cache)
    before = GlobalState.now()
    yield
    torch._dynamo.reset()
    assert GlobalState.now() == before, "the test left global state changed"


def pytest_collection_modifyitems(config, items):
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

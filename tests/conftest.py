"""Shared test setup: the repo root on sys.path (for tests.models), a clean Dynamo cache per test, and a check
that no test leaves thread-local state (grad mode, autocast, functorch levels, default dtype) changed."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    from cgcompile.runtime.drivers.thread_state import GlobalState
    torch._dynamo.reset()
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

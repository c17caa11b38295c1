"""One compiled model called from several Python threads at once (a thread per request in a server, a data
thread running inference beside training): the runtime's graphs, their static buffers and its bookkeeping are one
model's state, so the calls into one compiled frame, and its backward graphs, run one at a time. Tiny dense GPT
(tests/models), attn and mlp captured, emulate driver. Before the calls were serialized, three inference threads
got 204 of 450 outputs wrong (another thread's replay wrote the static buffers between a replay and its copy-out)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from cgcompile import stats
from tests.models import dense_gpt
from tests.test_runtime_traps import assert_close

OPTIONS = {"cuda_graph_modules": ["attn", "mlp"], "driver": "emulate", "cuda_graph_warmup_steps": 1}


def in_threads(work, threads: int) -> list:
    """`work(i)` in `threads` threads started together (a barrier): their results by i; the first error raised."""
    barrier, results, errors = threading.Barrier(threads), [None] * threads, []

    def body(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as error:  # noqa: BLE001  # re-raised in the calling thread
            errors.append(error)

    started = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()
    if errors:
        raise errors[0]
    return results


def check_inference_threads(device: str = "cpu", threads: int = 3, calls: int = 30, **options) -> None:
    """Each of `threads` threads runs its own inputs through the one compiled model `calls` times: every output
    equals eager's for those inputs, and the graphs replayed through it."""
    torch.manual_seed(0)
    ref = dense_gpt.build(2).to(device).eval()
    compiled = torch.compile(copy.deepcopy(ref), backend="cudagraph_modules", options={**OPTIONS, **options})
    inputs = [dense_gpt.example_inputs(seed=i, device=device)[0] for i in range(threads)]
    with torch.no_grad():
        expected = [ref(x) for x in inputs]
        compiled(inputs[0])
        compiled(inputs[0])  # captured and replayed once before the threads start
    before = stats()["steady_replays"]

    def work(i):
        with torch.no_grad():  # grad mode is per thread
            return [compiled(inputs[i]) for _ in range(calls)]

    outputs = in_threads(work, threads)
    for i, got in enumerate(outputs):
        for out in got:
            assert_close(out, expected[i])
    assert stats()["steady_replays"] > before + calls * (threads - 1)


def check_training_threads(device: str = "cpu", threads: int = 2, steps: int = 8, **options) -> None:
    """Each of `threads` threads takes forward and `torch.autograd.grad` on its own batch `steps` times (no update,
    so every call's answer is known): every gradient equals eager's for that batch, and the graphs replayed."""
    torch.manual_seed(0)
    ref = dense_gpt.build(2).to(device)
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="cudagraph_modules", options={**OPTIONS, **options})
    batches = [dense_gpt.example_inputs(seed=10 + i, device=device)[0] for i in range(threads)]

    def grads(net, call, tokens):
        return torch.autograd.grad(dense_gpt.lm_loss(call(tokens), tokens), list(net.parameters()))

    expected = [grads(ref, ref, x) for x in batches]
    for _ in range(2):
        grads(model, compiled, batches[0])  # captured and replayed before the threads start
    before = stats()["steady_replays"]

    def work(i):
        return [grads(model, compiled, batches[i]) for _ in range(steps)]

    results = in_threads(work, threads)
    for i, taken in enumerate(results):
        for got in taken:
            for g, e in zip(got, expected[i]):
                assert_close(g, e)
    assert stats()["steady_replays"] > before


@pytest.mark.parametrize("scope,host_path", [("layer", "compiled"), ("layer", "python"), ("block", "compiled")])
def test_inference_from_three_threads_gives_each_caller_its_own_answer(scope, host_path, request):
    """Layer scope (a partition per attn and mlp) and block scope (the frame one captured call: its steady replay
    the compiled one, steady_replay.cpp), with the compiled host path and without it (the lock taken in Python:
    runtime/local/serialized.py)."""
    if host_path == "python":
        request.getfixturevalue("python_host_path")
    check_inference_threads(inference_cuda_graph_scope=scope)


def test_training_steps_from_two_threads_give_each_caller_its_own_gradients():
    check_training_threads()

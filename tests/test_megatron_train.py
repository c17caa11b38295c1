"""A real Megatron-Core GPTModel (local spec, MoE with the allgather dispatcher and aux loss), tagged with
`cgcompile.tag_megatron` and compiled with `cuda_graph_modules=["attn", "moe_router"]`, trains exactly like
eager on the CPU with the emulate driver, replaying its attention and router graphs. Runs where Megatron-Core
is importable (`make megatron-parity` sets up a Python 3.12 venv with it); skipped elsewhere.

Megatron-Core assumes CUDA in a few places that even its eager model reaches; each is worked around in a named
fixture below, for both models alike."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

import cgcompile
from cgcompile.backend import cudagraph_modules, record_plans
from cgcompile.runtime import live_runtimes

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed (make megatron-parity runs this under a "
                                       "Python 3.12 venv with megatron-core==0.19.2)")

VOCAB, SEQ, BATCH = 64, 8, 2
OPTIONS = {"driver": "emulate", "cuda_graph_modules": ["attn", "moe_router"], "cuda_graph_warmup_steps": 1}


@pytest.fixture(scope="module")
def model_parallel():
    """One gloo rank, tensor/pipeline parallel size 1: what Megatron's layers look up at construction."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def rng_tracker_without_cuda():
    """Megatron's RNG tracker keeps CUDA generator states (model_parallel_cuda_manual_seed seeds them) and forks
    them around attention dropout; its inference tracker forks nothing, and dropout is 0 here."""
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    yield
    megatron_random.initialize_rng_tracker(force_reset=True)


@pytest.fixture
def global_memory_buffer_on_cpu(monkeypatch):
    """DotProductAttention takes its score buffer from the global memory buffer, which allocates on
    torch.cuda.current_device(): a fresh CPU tensor instead (baddbmm with beta=0 overwrites it)."""
    from megatron.core import parallel_state

    class CpuBuffer:
        def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
            return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", CpuBuffer)


@pytest.fixture
def router_weight_stays_on_cpu(monkeypatch):
    """TopKRouter.gating moves a CPU weight to torch.cuda.current_device() at every call, and the aux-loss code
    makes its tensors there: the current device is the CPU."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))


@pytest.fixture
def backend_registered():
    """The megatron venv runs cgcompile from PYTHONPATH, without the installed entry point that names the
    backend."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "cudagraph_modules" not in list_backends(exclude_tags=()):
        register_backend(name="cudagraph_modules")(cudagraph_modules)


def tiny_gpt():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                               moe_aux_loss_coeff=0.01, moe_grouped_gemm=False, add_bias_linear=False,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                               params_dtype=torch.float32, pipeline_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPTModel's deprecation notice
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4,
                                                                                       moe_grouped_gemm=False),
                        vocab_size=VOCAB, max_sequence_length=SEQ)


def batch(step):
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    # the causal mask as Megatron's training loop passes it (without one, its default mask is made on "cuda")
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return ids, positions, mask, labels


def train_step(model, optimizer, step):
    ids, positions, mask, labels = batch(step)
    optimizer.zero_grad()
    loss = model(ids, positions, mask, labels=labels).mean()
    loss.backward()
    module = getattr(model, "_orig_mod", model)  # the compiled wrapper's names carry a prefix
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    optimizer.step()
    return loss.detach(), grads


@pytest.mark.usefixtures("model_parallel", "rng_tracker_without_cuda", "global_memory_buffer_on_cpu",
                         "router_weight_stays_on_cpu", "backend_registered")
def test_tag_megatron_gpt_trains_like_eager_and_replays_attention_and_router():
    torch.manual_seed(0)
    eager, ours = tiny_gpt(), tiny_gpt()
    ours.load_state_dict(eager.state_dict())
    assert cgcompile.tag_megatron(ours) == {"attn": 2, "moe": 2, "moe_router": 2}
    cgcompile.release()
    cgcompile.reset_stats()
    compiled = torch.compile(ours, backend="cudagraph_modules", options=OPTIONS)
    eager_opt, our_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, ours))
    with record_plans() as plans:
        for step in range(4):
            eager_loss, eager_grads = train_step(eager, eager_opt, step)
            our_loss, our_grads = train_step(compiled, our_opt, step)
            torch.testing.assert_close(our_loss, eager_loss, rtol=0, atol=0)
            assert our_grads.keys() == eager_grads.keys()
            for name, grad in eager_grads.items():
                torch.testing.assert_close(our_grads[name], grad, rtol=0, atol=0, msg=f"step {step}: {name}")
    for ours_p, eager_p in zip(ours.parameters(), eager.parameters()):
        torch.testing.assert_close(ours_p, eager_p, rtol=0, atol=0)
    stats = cgcompile.stats()
    assert stats["eager_fallbacks"] == []
    # the partitions planned "capture" for each selected tag, replayed forward and backward (reuse, not captures)
    label_tags = {g.runner_name(p): set(p.tags) for g in plans.graphs for p in g.partitions
                  if p.captured}
    replayed = {(tag, graph.kind) for runtime in live_runtimes() for graph in runtime.live_graphs()
                if graph.replays > 0 for tag in label_tags.get(graph.partition, ())}
    assert replayed == {(tag, kind) for tag in ("attn", "moe_router") for kind in ("forward", "backward")}
    cgcompile.release()

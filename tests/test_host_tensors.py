"""Host tensors on a graph that runs on an accelerator (cgcompile/passes/host_tensors.py): every op that reads a
CPU tensor input, or a CPU tensor computed from one, stays eager, since a CUDA graph keeps the value a host
operand had at capture.

Dynamo cannot trace fake CUDA tensors on a CPU-only build of torch, so the model here is on the meta device, which
plays the accelerator: the frame's device is then meta (devices.py), and a CPU 0-d tensor beside it is on the
host as it would be beside a CUDA model. Meta tensors hold no data, so these tests read the plan only; the CUDA
twin, which replays with a new value at every call, is tests/gpu/test_gpu_host_tensors.py."""

import re

import expecttest
import pytest
import torch
import torch.nn as nn

import cgcompile
from cgcompile.backend import record_plans
from cgcompile.passes import analyze
from tests.host_cases import Scaled
from tests.test_passes import graphs_of

OPTIONS = {"cuda_graph_modules": [], "min_partition_ops": 1}


def planned(model, *args, dynamic=False):
    torch._dynamo.reset()
    with record_plans() as rec:
        torch.compile(model, backend="cudagraph_modules", options=OPTIONS, dynamic=dynamic)(*args)
    torch._dynamo.reset()
    return cgcompile.Plan(cgcompile.CudaGraphConfig.from_options(OPTIONS), list(rec.graphs))


class TestHostTensors(expecttest.TestCase):
    def test_on_the_device_every_read_of_a_host_input_stays_eager_with_its_reason(self):
        plan = planned(Scaled().to("meta"), torch.empty(2, 4, device="meta"), torch.tensor(0.5))
        table = re.sub(r"graph \d+", "graph N", str(plan).split("\n", 1)[1])  # graphs count across the process
        self.assertExpectedInline(table, """\
graph N (training, layer scope): 4 partitions, 2 captured, 2 eager; 7/9 ops captured; runs eagerly: tensors are on meta (capture marks what would be captured on a GPU)
id  kind     tags  module  ops  first reason
 0  eager    -     -         1  host_tensor: operator.mul at host_cases.py:17
 1  capture  -     -         4  -
 2  eager    -     -         1  host_tensor: operator.mul at host_cases.py:19
 3  capture  -     -         3  -""")
        details = [r.detail for p in plan.graphs[0].partitions for r in p.reasons]
        self.assertExpectedInline("\n".join(details), """\
reads argument `scale` (read at host_cases.py:17), a tensor in host memory, on a graph that runs on the device: a CUDA graph replays no host work, and its kernels keep a host operand's value from the capture
reads `doubled` from operator.mul (created at host_cases.py:17), a host tensor computed from argument `scale` (read at host_cases.py:17), on a graph that runs on the device: a CUDA graph replays no host work, and its kernels keep a host operand's value from the capture""")
        hints = {r.hint for p in plan.graphs[0].partitions for r in p.reasons}
        assert hints == {"move the tensor to the model's device before the call (`t.to(device)`), or pass a Python "
                         "number; a CUDA graph keeps the value a host tensor had at capture"}

    def test_on_the_cpu_the_host_is_the_device_and_the_model_is_captured_whole(self):
        plan = planned(Scaled(), torch.randn(2, 4), torch.tensor(0.5))
        assert [(p.kind, p.captured) for p in plan.graphs[0].partitions] == [("capture", True)]

    def test_a_python_number_dynamo_passes_as_a_tensor_is_a_scalar_input_not_a_host_tensor(self):
        class Eps(nn.Module):
            def forward(self, x, eps):
                return x * eps

        plan = planned(Eps(), torch.empty(3, device="meta"), 0.5, dynamic=True)
        assert {r.category for p in plan.graphs[0].partitions for r in p.reasons} == {"scalar_input"}

    def test_a_host_tensor_the_code_makes_from_constants_is_no_host_read(self):
        def fn(x):
            y = x * torch.tensor(2.0) + torch.tensor(1.0) * 3  # the same values at every call
            return y.to(torch.tensor(1, dtype=torch.float16).dtype)  # reads the host tensor's dtype only

        (gm,) = graphs_of(fn, torch.empty(3, device="meta"))
        assert analyze(gm) == {}

    def test_a_host_tensor_made_from_constants_and_copied_to_the_device_is_a_host_sync(self):
        def fn(x):
            positions = torch.arange(3) * 2  # on the host: the same values at every call
            return x + positions.to(x.device) + torch.tensor(1.0).type_as(x)  # copies from pageable memory

        (gm,) = graphs_of(fn, torch.empty(3, device="meta"))
        (node, (found,)), (moved, (also,)) = analyze(gm).items()
        assert (node.target, found.category, found.op) == ("to", "host_sync", "Tensor.to")
        assert (moved.target, also.category) == ("type_as", "host_sync")
        self.assertExpectedInline(found.detail, """copies `positions` from operator.mul (created at test_host_tensors.py:75), a tensor in host memory, to the device: a copy from pageable host memory waits for the host, which a capture cannot hold""")

    def test_a_host_tensor_brought_from_the_device_is_read_eagerly_too(self):
        def fn(x, y):
            peak = x.max().cpu()  # a sync (host_sync), and a host value that changes at every call
            return y * peak

        graphs = []
        with pytest.raises(NotImplementedError, match="no data"):  # the graph runs: meta tensors have no data
            torch.compile(fn, backend=lambda gm, _: graphs.append(gm) or gm.forward)(
                torch.empty(3, device="meta"), torch.empty(3, device="meta"))
        (gm,) = graphs
        found = {node.name: [(f.category, f.op) for f in fs] for node, fs in analyze(gm).items()}
        assert found == {"peak": [("host_sync", "Tensor.cpu")], "mul": [("host_tensor", "operator.mul")]}
        (mul,) = [f for node, fs in analyze(gm).items() for f in fs if f.category == "host_tensor"]
        self.assertExpectedInline(mul.detail, """reads `peak` from Tensor.cpu (created at test_host_tensors.py:86), a host tensor made at each call, on a graph that runs on the device: a CUDA graph replays no host work, and its kernels keep a host operand's value from the capture""")

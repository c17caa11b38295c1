"""The wording of the plan table, log lines and JSON, pinned with expecttest (EXPECTTEST_ACCEPT=1 to update)."""

import json
import logging
import os
import subprocess
import sys

import expecttest
import torch
import torch.nn as nn

import cgcompile
from cgcompile.diagnostics import full_iteration_error, log_graph_plan


@cgcompile.tag("attn")
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x)) * 2


@cgcompile.tag("moe")
class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x):
        idx = torch.nonzero(x[:, 0] > 0).squeeze(1)
        return x.index_add(0, idx, self.up(x[idx]))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.moe = Attn(), Moe()

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.moe(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer()])

    def forward(self, x):
        x = self.layers[0](x)
        return x.sum().tolist()


@cgcompile.tag("mlp")
class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.up(x))


class Stack(nn.Module):
    """An untagged projection before two tagged modules: each partition's first input comes from the op before."""

    def __init__(self):
        super().__init__()
        self.proj, self.attn, self.mlp = nn.Linear(8, 8), Attn(), Mlp()

    def forward(self, x):
        return self.mlp(self.attn(self.proj(x)))


def make_plan(**options):
    torch.manual_seed(0)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        return cgcompile.explain(Net(), torch.randn(4, 8), options={"cuda_graph_modules": ["attn", "moe"], **options})


class TestDiagnostics(expecttest.TestCase):
    def test_plan_table(self):
        self.assertExpectedInline(str(make_plan()), """\
cgcompile plan: cuda_graph_impl=local, cuda_graph_modules=[attn, moe], inference_cuda_graph_scope=layer, warmup=3, driver=auto
graph 0 (training, layer scope): 2 partitions, 1 captured, 1 eager; 4/16 ops captured; runs eagerly: tensors are on cpu (capture marks what would be captured on a GPU)
id  kind     tags  module    ops  first reason
 0  capture  attn  layers.0    4  -
 1  eager    moe   -          12  dynamic_shape: torch.nonzero at test_diagnostics.py:34
Dynamo graph breaks (1), each runs in Python between graphs:
  test_diagnostics.py:55: Tensor.tolist() with non-integer tensor""")

    def test_emulate_and_eager_driver_headers(self):
        emulate = str(make_plan(driver="emulate")).splitlines()[1]
        eager = str(make_plan(driver="eager")).splitlines()[1]
        self.assertExpectedInline(emulate.split("; ")[-1], """driver=emulate: capture is emulated on the CPU""")
        self.assertExpectedInline(eager.split("; ")[-1], """driver=eager: nothing is captured (capture marks what would be)""")

    def test_json_schema(self):
        data = make_plan().to_json()
        json.dumps(data)  # serializable
        self.assertEqual(set(data), {"config", "graphs", "graph_breaks", "measured"})
        self.assertEqual(data["measured"], {})  # filled by runs with measure_benefit (tests/test_benefit.py)
        self.assertEqual(data["config"]["cuda_graph_modules"], ["attn", "moe"])
        (graph,) = data["graphs"]
        self.assertIsInstance(graph["index"], int)
        for part in graph["partitions"]:
            self.assertLessEqual({"id", "kind", "tag", "module", "num_ops", "reasons"}, set(part))
            self.assertIn(part["kind"], ("capture", "eager"))
            for reason in part["reasons"]:
                self.assertLessEqual({"category", "op", "location", "module", "hint"}, set(reason))
        eager = graph["partitions"][1]
        self.assertEqual(eager["tags"], ["moe"])
        self.assertEqual(eager["tag"], "moe")
        first = eager["reasons"][0]
        self.assertEqual((first["category"], first["op"], first["module"]), ("dynamic_shape", "torch.nonzero", "layers.0.moe"))
        self.assertEqual(first["location"], f"{os.path.abspath(__file__)}:{Moe.forward.__code__.co_firstlineno + 1}")
        self.assertIn("dynamic_padding='max'", first["hint"])  # this loop could be padded exactly
        (brk,) = data["graph_breaks"]
        self.assertEqual(brk["location"], f"{os.path.abspath(__file__)}:{Net.forward.__code__.co_firstlineno + 2}")

    def test_full_iteration_error_names_the_reason_before_the_path(self):
        text = full_iteration_error(make_plan().graphs[0]).replace(os.path.abspath(__file__), "<file>")
        self.assertExpectedInline(text, """\
cuda_graph_impl='full_iteration' needs the whole step in one graph, but graph 0 has 1 op(s) that cannot be captured:
  dynamic_shape torch.nonzero at <file>:34 in layers.0.moe -- set dynamic_padding='max' (no host sync) or 'buckets' to capture the rows it selects; the padding is exact
  (and 8 op(s) whose shapes depend on their results)
Fix them, or use cuda_graph_impl='local' to capture around them.""")

    def test_log_lines(self):
        plan = make_plan()
        logger = logging.getLogger("cgcompile")
        with self.assertLogs(logger, level="DEBUG") as logs:
            log_graph_plan(plan.graphs[0], plan.config)
        info = [r.getMessage() for r in logs.records if r.levelno == logging.INFO]
        debug = [r.getMessage() for r in logs.records if r.levelno == logging.DEBUG]
        self.assertEqual(len(info), 1)
        self.assertEqual(info[0].splitlines()[0], str(plan).splitlines()[1])
        self.assertExpectedInline(debug[0].replace(os.path.abspath(__file__), "<file>"), """graph 0 node nonzero: dynamic_shape torch.nonzero at <file>:34 in layers.0.moe: output shape depends on tensor data (u0); hint: set dynamic_padding='max' (no host sync) or 'buckets' to capture the rows it selects; the padding is exact""")

    def test_backend_logs_once_per_graph(self):
        logger = logging.getLogger("cgcompile")
        with self.assertLogs(logger, level="INFO") as logs, \
                torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            torch.compile(Net(), backend="cudagraph_modules", options={"cuda_graph_modules": ["attn", "moe"]})(
                torch.randn(4, 8))
        summaries = [r.getMessage().splitlines()[0] for r in logs.records if r.getMessage().startswith("graph ")]
        self.assertEqual(len(summaries), 1)
        self.assertIn("2 partitions, 1 captured, 1 eager", summaries[0])

    def test_graph_labels_name_the_partitions_own_code(self):
        """A partition's inputs keep the meta of the ops that made them: the labels named the module before it
        (the attn partition read `Stack.forward`, the mlp one `Attn.forward`)."""
        torch.manual_seed(0)
        compiled = torch.compile(Stack(), backend="cudagraph_modules",
                                 options={"cuda_graph_modules": ["attn", "mlp"], "driver": "emulate",
                                          "cuda_graph_warmup_steps": 1})
        for _ in range(2):
            compiled(torch.randn(4, 8)).sum().backward()
        labels = sorted(g["label"].split(" [")[0].split(" in ", 1)[1] + " " + g["kind"]
                        for g in cgcompile.stats()["graphs"])
        self.assertExpectedInline("\n".join(labels), """\
Attn.forward (test_diagnostics.py:24) backward
Attn.forward (test_diagnostics.py:24) forward
Mlp.forward (test_diagnostics.py:65) backward
Mlp.forward (test_diagnostics.py:65) forward""")

    def test_torch_logs_enables_our_logger(self):
        code = ("import torch, logging, cgcompile\n"
                "print(logging.getLogger('cgcompile').getEffectiveLevel())")
        env = {**os.environ, "TORCH_LOGS": "+cgcompile"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(out.stdout.strip(), str(logging.DEBUG), out.stderr[-2000:])


if __name__ == "__main__":
    import unittest
    unittest.main()

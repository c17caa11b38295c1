"""Hints that fit the code: a graph break or a host read gets the fix that exists where the op is written
(transformers, torchtitan, Megatron-Core, the user's own code), told apart by the source file's path, or by the
module class's `__module__` where there is no path. One test per source; the text pinned with expecttest
(EXPECTTEST_ACCEPT=1 to update)."""

import importlib.util
import pathlib
import sys
import textwrap

import expecttest
import torch
import torch.nn as nn

import cgcompile
from cgcompile.code_source import CodeSource, source_of

# the same code, written in a file under each library's package directory (as installed in site-packages)
LIBRARY_CODE = textwrap.dedent("""\
    import torch

    def breaks(x):
        return x[torch.nonzero(x[:, 0] > 0).squeeze(1)].sum() + x  # a Dynamo break: a data-dependent size

    def reads(x):
        t = x.clone()
        t[x < 0] = 0  # a host read: a boolean-mask assignment
        return t
""")
FILES = {"transformers": "transformers/models/fake/modeling_fake.py", "torchtitan": "torchtitan/models/moe/moe.py",
         "megatron": "megatron/core/transformer/moe/token_dispatcher.py", "user": "my_project/model.py"}


def load(tmp: pathlib.Path, which: str):
    path = tmp / FILES[which]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(LIBRARY_CODE)
    spec = importlib.util.spec_from_file_location(f"cgtest_code_source_{which}", path)  # the path alone decides
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Dynamo looks a traced function's module up by name
    spec.loader.exec_module(module)
    return module


class Model(nn.Module):
    def __init__(self, code):
        super().__init__()
        self.lin, self.code = nn.Linear(4, 4), code

    def forward(self, x):
        return self.code.reads(self.code.breaks(self.lin(x)))


def hints(tmp: pathlib.Path, which: str) -> str:
    torch._dynamo.reset()
    plan = cgcompile.explain(Model(load(tmp, which)), torch.randn(4, 4), options={"driver": "emulate"})
    [brk] = plan.graph_breaks
    [read] = [f for g in plan.graphs for p in g.partitions for f in p.reasons if f.category == "host_sync"]
    assert read.location.startswith(str(tmp / FILES[which]))
    return f"break: {brk.hint}\nread: {read.hint}"


class TestHintsBySource(expecttest.TestCase):
    def setUp(self):
        import tempfile
        self._dir = tempfile.TemporaryDirectory()
        self.tmp = pathlib.Path(self._dir.name)

    def tearDown(self):
        self._dir.cleanup()
        for which in FILES:
            sys.modules.pop(f"cgtest_code_source_{which}", None)

    def test_user_code(self):
        self.assertExpectedInline(hints(self.tmp, "user"), """\
break: the code after this data-dependent size runs in Python, so dynamic_padding cannot pad it: loop over a fixed range (`for e in range(num_experts): idx, top = torch.where(mask[e])`) with torch._dynamo.config.capture_dynamic_output_shape_ops=True and dynamic_padding='max' or 'buckets'
read: write through the mask on the device: t.masked_fill_(mask, value) or torch.where(mask, value, t)""")

    def test_transformers(self):
        self.assertExpectedInline(hints(self.tmp, "transformers"), """\
break: transformers 5's eager experts loop (`for expert_idx in expert_hit`) runs in Python after this data-dependent size, so dynamic_padding cannot pad it: use experts_implementation='grouped_mm' (the default), which traces without a break
read: inside transformers' modeling code: it runs eagerly, the rest is captured around it; to capture no island, leave this module out of cuda_graph_modules (for MoE experts: experts_implementation='grouped_mm' with bfloat16 weights reads nothing on the host)""")

    def test_torchtitan(self):
        self.assertExpectedInline(hints(self.tmp, "torchtitan"), """\
break: torchtitan's MoE reads tokens per expert on the host here (the for-loop experts, or expert parallel's all-to-all split sizes): keep MoEArgs(use_grouped_mm=True) (the default) and leave the token dispatch eager (tag and select attention and the router only)
read: inside torchtitan: it runs eagerly, the rest is captured around it; in MoE keep MoEArgs(use_grouped_mm=True) (the default; the for-loop experts read tokens per expert on the host) and leave the token dispatch out of the captured regions""")

    def test_megatron_core(self):
        self.assertExpectedInline(hints(self.tmp, "megatron"), """\
break: Megatron-Core's token dispatcher sizes its buffers by the routing (tokens per expert, read on the host): leave the dispatch eager as Megatron's partial CUDA graphs do (cgcompile.tag_megatron(model), cuda_graph_modules=['attn', 'moe_router']), or make its shapes static with TransformerConfig(moe_expert_capacity_factor=..., moe_pad_expert_input_to_capacity=True)
read: inside Megatron-Core: it runs eagerly, the rest is captured around it; to capture what Megatron's --cuda-graph-scope does, cgcompile.tag_megatron(model) and cuda_graph_modules=['attn', 'moe_router'] (in the MoE token dispatcher, TransformerConfig(moe_expert_capacity_factor=..., moe_pad_expert_input_to_capacity=True) makes its shapes static)""")


def test_source_of_reads_the_path_first_then_the_module_class():
    assert source_of("/venv/lib/python3.12/site-packages/megatron/core/tensor_parallel/cross_entropy.py") \
        is CodeSource.MEGATRON_CORE
    assert source_of("/home/me/torchtitan/torchtitan/models/moe/moe.py") is CodeSource.TORCHTITAN
    assert source_of("/home/me/transformers-fork/train.py") is CodeSource.USER  # a directory named alike is not it
    assert source_of("/home/me/train.py", "megatron.core.transformer.moe.moe_layer") is CodeSource.USER
    assert source_of(None, "transformers.models.llama.modeling_llama") is CodeSource.TRANSFORMERS
    assert source_of(None, "__main__") is CodeSource.USER

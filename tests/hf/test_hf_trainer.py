"""The Hugging Face Trainer path the docs give (docs/guides/huggingface.md): the page's snippets compile a tiny
Llama with `model.compile(backend="cudagraph_modules", ...)` and train it with `Trainer`. Checked here: every
partition captured once and replayed on every step after it, nothing fell back to eager, and each step's loss
equals an eager Trainer run's on the same data and arguments. Also: accelerate still rejects the backend name
through `TrainingArguments(torch_compile_backend=...)`, the limitation the page documents."""

import pytest
import torch

import cgcompile
from tests.doc_snippets import REPO, run_page

PAGE = REPO / "docs/guides/huggingface.md"
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def logged_losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_on_a_compiled_model_replays_graphs_and_matches_eager(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    page, _ = run_page(PAGE)
    stats = cgcompile.stats()
    steps, warmup = page["args"].max_steps, cgcompile.CudaGraphConfig().cuda_graph_warmup_steps
    rows = stats["partitions"]
    assert rows and stats["eager_fallbacks"] == []
    for row in rows:  # one call per step: warmup, one capture, then a replay on every later step
        assert (row["calls"], row["captures"], row["recaptures"]) == (steps, 1, 0), row
        assert row["replays"] == steps - warmup - 1, row

    torch.manual_seed(0)  # the page's seed: the same initial weights, uncompiled
    eager = transformers.AutoModelForCausalLM.from_config(page["config"], attn_implementation="eager")
    reference = transformers.Trainer(model=eager, args=page["args"], train_dataset=page["dataset"])
    reference.train()
    assert len(logged_losses(page["trainer"])) == steps
    assert logged_losses(page["trainer"]) == logged_losses(reference)


def test_accelerate_rejects_the_backend_name_as_the_page_says():
    """Trainer builds this plugin from TrainingArguments(torch_compile_backend=...); when accelerate starts
    accepting other backends, this fails and the page's warning can go."""
    from accelerate.utils import TorchDynamoPlugin
    with pytest.raises(ValueError, match="'CUDAGRAPH_MODULES' is not a valid DynamoBackend"):
        TorchDynamoPlugin(backend="cudagraph_modules")
    assert "'CUDAGRAPH_MODULES' is not a valid DynamoBackend" in PAGE.read_text()


def test_trainer_with_gradient_checkpointing_and_dropout_replays_the_tagged_modules_and_matches_eager(tmp_path,
                                                                                                       monkeypatch):
    """TrainingArguments(gradient_checkpointing=True) on a model compiled first: Trainer checkpoints every decoder
    layer after compiling, so each layer is a checkpoint whose body holds the tagged attention and MLP. They are
    captured and replayed, and with attention dropout each step's loss and gradient norm equal eager Trainer's
    (reentrant checkpointing, Trainer's default, and non-reentrant)."""
    monkeypatch.chdir(tmp_path)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.1)
    tokens = torch.randint(0, 64, (12, 8), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": ids, "labels": ids} for ids in tokens]
    steps = 6

    def train(compiled, reentrant):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        if compiled:
            cgcompile.tag_hf(model)
            model.compile(backend="cudagraph_modules", options={"cuda_graph_modules": ["attn", "mlp"],
                                                                "driver": "emulate"})
        args = transformers.TrainingArguments(
            output_dir="out", max_steps=steps, per_device_train_batch_size=2, optim="sgd", learning_rate=0.1,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
        return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]

    warmup = cgcompile.CudaGraphConfig().cuda_graph_warmup_steps
    for reentrant in (True, False):
        torch._dynamo.reset()
        cgcompile.reset_stats()
        got = train(True, reentrant)
        rows = cgcompile.stats()["partitions"]
        assert len(rows) == 2 and cgcompile.stats()["eager_fallbacks"] == []  # a layer's attn+mlp, per layer
        for row in rows:
            assert (row["calls"], row["captures"], row["replays"]) == (steps, 1, steps - warmup - 1), row
        assert len(got) == steps and got == train(False, reentrant)

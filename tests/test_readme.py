"""The README's training loop and the trainers page's snippets run as written and log what they say,
on the objects their text presumes (a model, a data loader, a Trainer's arguments, an accelerator)."""

from __future__ import annotations

import warnings

import pytest
import torch

from snippets import README, ROOT, python_blocks

TRAINERS = ROOT / "docs" / "guides" / "trainers.md"


def test_the_pages_have_the_snippets_this_test_runs():
    assert "for x, y in loader:" in python_blocks(README)[0]
    assert "transformers.Trainer" in "".join(python_blocks(TRAINERS))


def test_the_training_loop_snippet_runs_and_logs_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITORED_OPTIM_BACKEND", "jsonl")
    monkeypatch.setenv("MONITORED_OPTIM_LOGDIR", str(tmp_path))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    loader = [(torch.randn(16, 4), torch.randn(16, 2)) for _ in range(5)]
    namespace = {"model": model, "loader": loader, "loss_fn": torch.nn.functional.mse_loss}
    exec(python_blocks(README)[0], namespace)
    opt = namespace["opt"]
    assert opt.monitor.step == 5
    assert "update_to_data/0.weight" in opt.monitor.latest
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5


def test_the_trainer_snippets_build_their_optimizers(tmp_path, monkeypatch):
    """Each block of the trainers page, run in order in one namespace, with a tiny GPT-2, TrainingArguments and an
    accelerate Accelerator on the CPU."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("MONITORED_OPTIM_LOGDIR", str(tmp_path / "runs"))
    monkeypatch.setenv("MONITORED_OPTIM_BACKEND", "none")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    train = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(4)]
    loader = torch.utils.data.DataLoader(torch.randn(8, 16), batch_size=4)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    namespace = {"model": model, "args": args, "train": train, "loader": loader, "decay": decay,
                 "no_decay": no_decay, "accelerator": accelerate.Accelerator(cpu=True), "transformers": transformers}
    from monitored_optim import Monitored, MonitorConfig  # noqa: F401 - the snippet's names
    namespace.update(torch=torch, Monitored=Monitored, MonitorConfig=MonitorConfig)
    lightning = pytest.importorskip("lightning")
    namespace["lightning"] = lightning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for block in python_blocks(TRAINERS):
            if "ray.train" in block:  # run alone, on a Ray cluster of its own: test_docs.py, test_integrations.py
                continue
            exec(block, namespace)
            if "transformers.Trainer(" in block and "callbacks=[MonitorCallback()]" in block:
                hf_trainer = namespace["trainer"]  # a Lightning Trainer takes the name later
    ours = [str(w.message) for w in seen if str(w.message).startswith("monitored_optim")]
    assert all("log the same tags" in m for m in ours), ours  # several optimizers in one namespace, one logdir
    from monitored_optim import monitor_of
    from monitored_optim.hf import MonitorCallback

    trainer = hf_trainer
    assert isinstance(trainer, transformers.Trainer) and any(isinstance(c, MonitorCallback)
                                                             for c in trainer.callback_handler.callbacks)
    monitor = monitor_of(trainer.optimizer)  # the callback's, inside accelerate's wrapper
    assert monitor.step == trainer.state.global_step > 0 and len(trainer.optimizer.param_groups) == 2
    assert namespace["callback"].config.every == 10
    grouped = namespace["grouped"].create_optimizer()  # the Trainer's decay / no-decay groups, named from the model
    assert len(grouped.param_groups) == 2 and "param0" not in grouped.monitor.describe()
    assert namespace["built"].optimizer is namespace["built"].create_optimizer()  # the one given
    assert callable(namespace["monitored_engine"]) and callable(namespace["configure_optimizers"])
    lit = namespace["trainer"]
    assert isinstance(lit, lightning.Trainer) and any(type(c).__module__ == "monitored_optim.lightning"
                                                      for c in lit.callbacks)
    nanogpt = namespace["opt"].monitor  # the last line: bare tensors, named from MonitorConfig(model=)
    assert "transformer.h.0.attn.c_attn.weight" in nanogpt.describe() and "param0" not in nanogpt.describe()

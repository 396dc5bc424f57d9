"""Inside the real trainers (the ``integrations`` extra): the Hugging Face Trainer on a tiny random
GPT-2, Lightning's Trainer and accelerate. Each run is compared with the same run on the plain
optimizer (bit for bit), and its step count, names and offline W&B rows are read back."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from monitored_optim import Monitored, MonitorConfig
from wandb_files import read_metric_definitions, read_monitor_rows, read_rows

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")
accelerate = pytest.importorskip("accelerate")

FAMILIES = ("update_to_data/*", "update_norm/*", "global/*", "lr/*", "health/*")


def offline_run(root: Path) -> Path:
    import wandb

    if wandb.run is not None:  # HF's callback leaves its run open after train()
        wandb.run.finish()
    wandb.teardown()  # waits for wandb-core's files
    (run_dir,) = Path(root).rglob("offline-run-*")
    return run_dir


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (a language-modelling batch: labels are the inputs)."""

    def __init__(self, n: int, length: int = 16, vocab: int = 64) -> None:
        self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_gpt2(vocab: int = 64):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def hf_train(tmp_path: Path, monitored: bool):
    model = tiny_gpt2()
    if monitored:
        opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(
            backend="wandb", logdir=tmp_path / "monitor"))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=20, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        logging_steps=5, eval_strategy="steps", eval_steps=5, save_strategy="no", report_to=["wandb"] if monitored
        else [], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(80), eval_dataset=Tokens(8),
                                   optimizers=(opt, None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trainer's own notices (tokenizer-free model, cpu)
        trainer.train()
    return model, opt


def test_hf_trainer_with_wandb_keeps_every_row_at_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "hf-test")
    plain_model, _ = hf_train(tmp_path / "plain", monitored=False)
    model, opt = hf_train(tmp_path / "monitored", monitored=True)
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters()))
    assert opt.monitor.step == 20
    assert "update_to_data/transformer.h.1.attn.c_attn.weight" in opt.monitor.latest
    run_dir = offline_run(tmp_path)
    rows = read_monitor_rows(run_dir)
    assert sorted(rows) == list(range(1, 21))  # none dropped, each at its optimizer step
    assert rows[20]["update_norm/transformer.wte.weight"] == pytest.approx(
        opt.monitor.latest["update_norm/transformer.wte.weight"], rel=1e-12)
    assert any("eval/loss" in row for row in read_rows(run_dir))  # the trainer's rows are there too
    definitions = read_metric_definitions(run_dir)
    assert all(definitions[f] == "optimizer/step" for f in FAMILIES), definitions


class LitModel(lightning.LightningModule):
    def __init__(self, monitored: bool, logdir: Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.monitored, self.logdir = monitored, logdir

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        if self.monitored:
            return Monitored(torch.optim.AdamW)(self.named_parameters(), lr=1e-2, monitor=MonitorConfig(
                backend="wandb", logdir=self.logdir))
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def regression(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def lit_train(tmp_path: Path, monitored: bool):
    from lightning.pytorch.loggers import WandbLogger

    module = LitModel(monitored, tmp_path / "monitor")
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="lit-test") if monitored else False
    trainer = lightning.Trainer(max_steps=30, val_check_interval=10, logger=logger, accelerator="cpu", devices=1,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                log_every_n_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notices (num_workers, cpu)
        trainer.fit(module, regression(200, 0), regression(16, 1))
    return module, trainer


def test_lightning_with_wandb_logger_and_validation_keeps_every_row(tmp_path):
    plain, _ = lit_train(tmp_path / "plain", monitored=False)
    module, trainer = lit_train(tmp_path / "monitored", monitored=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), module.parameters()))
    opt = trainer.optimizers[0]
    assert opt.monitor.step == trainer.global_step == 30
    rows = read_monitor_rows(offline_run(tmp_path / "monitored"))
    assert sorted(rows) == list(range(1, 31))
    assert "update_to_data/net.0.weight" in rows[30]


def test_accelerate_prepared_optimizer_is_monitored(tmp_path):
    def run(monitored: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        if monitored:
            opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-2, monitor=MonitorConfig(
                backend="jsonl", logdir=tmp_path))
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        acc = accelerate.Accelerator(cpu=True)
        model, opt, loader = acc.prepare(model, opt, regression(64, 0))
        for x, y in loader:
            opt.zero_grad()
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
        return model, opt

    plain_model, _ = run(False)
    model, opt = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters()))
    assert isinstance(opt.optimizer, torch.optim.AdamW) and opt.optimizer.monitor.step == 16
    assert "update_to_data/2.weight" in opt.optimizer.monitor.latest


def test_hf_trainer_optim_name_monitored_through_its_class_and_kwargs(tmp_path):
    """``TrainingArguments(optim="adamw_bnb_8bit")`` monitored through the Trainer's own choice of
    class and arguments (``Trainer.get_optimizer_cls_and_kwargs``), as the trainers guide shows: the
    Trainer still recognises bitsandbytes in ``str(cls)`` and keeps the embeddings' state in 32 bits
    (the token embedding is above bitsandbytes' 4,096-element floor for 8-bit state), so the run
    equals the plain one bit for bit."""
    bnb = pytest.importorskip("bitsandbytes")
    manager = bnb.optim.GlobalOptimManager.get_instance()  # one per process: the Trainer's overrides stay
    runs = []
    for monitored in (True, False):  # the monitored run first: no override left by the plain one
        model = tiny_gpt2(vocab=256)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"hf{monitored}"), max_steps=6, per_device_train_batch_size=4,
            optim="adamw_bnb_8bit", save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
            dataloader_num_workers=0, disable_tqdm=True)
        extra = {}
        if monitored:
            cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
            extra["optimizer_cls_and_kwargs"] = (Monitored(cls), {**kwargs, "monitor": MonitorConfig(
                backend="jsonl", logdir=tmp_path / "monitor", model=model)})
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(40), **extra)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the trainer's own notices (tokenizer-free model, cpu)
                trainer.train()
        finally:
            for held in (manager.module_weight_config_triple, manager.pid2config, manager.index2config):
                held.clear()
        opt = trainer.optimizer.optimizer  # inside accelerate's wrapper
        assert opt.state[model.transformer.wte.weight]["state1"].dtype == torch.float32  # the Trainer's override
        if monitored:
            assert opt.monitor.step == 6 and "update_to_data/transformer.wte.weight" in opt.monitor.latest
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_ray_train_figures_land_under_the_runs_storage_path(tmp_path, monkeypatch, request):
    """The trainers guide's Ray Train block as written, with two workers under DDP (``prepare_model``): the
    figures are in ``<storage_path>/<name>/monitor``, one run of rank 0's rows (every step: the test's
    MONITORED_OPTIM_EVERY=1 reaches the workers), under the model's own names (no ``module.``), and none are in
    Ray's session folder, where the workers' working directory is."""
    import json
    import math

    from snippets import ROOT, python_blocks

    (block,) = [b for b in python_blocks(ROOT / "docs" / "guides" / "trainers.md") if "ray.train" in b]
    monkeypatch.setenv("MONITORED_OPTIM_BACKEND", "jsonl")  # before the cluster starts: its workers inherit it
    ray = request.getfixturevalue("ray_cluster")
    namespace: dict = {}
    exec(compile(block, "trainers.md#ray", "exec"), namespace)
    run_dir = tmp_path / "ray_results" / "tiny"
    assert Path(namespace["result"].path) == run_dir
    rows = [json.loads(line) for line in (run_dir / "monitor" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 21))  # rank 0 alone: each step once
    names = {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {tag.split("/", 1)[1] for tag in rows[-1] if tag.startswith("update_norm/")} == names
    assert all(math.isfinite(row[f"update_norm/{n}"]) and row[f"update_norm/{n}"] > 0 for row in rows for n in names)
    assert [p.name for p in (run_dir / "monitor").iterdir() if p.is_dir()] == []  # no run2: one writer
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    assert session.is_dir() and not list(session.glob("artifacts/**/metrics.jsonl"))

"""The trainers' callbacks (``monitored_optim.hf`` and ``monitored_optim.lightning``): one line added to
a trainer that builds its own optimizer. Each run's figures, read back from where the trainer logs,
equal the clone truth taken by the optimizer's own step hooks; the run equals the plain one bit for
bit; the x axis is the trainer's global step."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from monitored_optim import MonitorConfig
from truth import assert_figures_match, figures, snapshot

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")

MONITOR_FAMILIES = ("update_to_data/", "grad_to_data/", "update_norm/", "grad_norm/", "param_norm/", "global/",
                    "health/")


class Truths:
    """The clone truth of each step of ``opt``, taken by its own step hooks (clones before, figures after)."""

    def __init__(self, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self.opt = opt
        held = {id(p) for group in opt.param_groups for p in group["params"]}
        self.named = [(n, p) for n, p in model.named_parameters() if id(p) in held]
        self.steps: list[dict[str, float]] = []
        self._before = self._grads = None
        opt.register_step_pre_hook(self._pre)
        opt.register_step_post_hook(self._post)

    def grads(self) -> None:
        """Take the grads now (a step whose closure makes them: Lightning's, after its backward)."""
        self._grads = snapshot(self.named)[1]

    def _pre(self, *_):
        self._before = snapshot(self.named)

    def _post(self, *_):
        params, grads = self._before
        self.steps.append(figures(self.named, params, self._grads or grads))
        self._grads = None


def monitor_figures(row: dict[str, float]) -> dict[str, float]:
    """The monitor's figures of a row that holds the trainer's too."""
    return {k: v for k, v in row.items() if k.startswith(MONITOR_FAMILIES)}


def read_tensorboard(logdir: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for events in sorted({p.parent for p in Path(logdir).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for event in acc.Scalars(tag):
                out.setdefault(event.step, {})[tag] = event.value
    return out


def inner(opt):
    """The torch optimizer inside the trainers' wrappers."""
    while not type(opt).__module__.startswith(("torch.", "monitored_optim.", "transformers.optimization")):
        opt = getattr(opt, "_optimizer", None) or opt.optimizer
    return opt


# ---------------------------------------------------------------------------------------- HF Trainer

def hf_trainer(tmp_path: Path, callbacks: list, **kwargs):
    from test_integrations import Tokens, tiny_gpt2

    model = tiny_gpt2()
    args = transformers.TrainingArguments(**{
        "output_dir": str(tmp_path), "max_steps": 6, "per_device_train_batch_size": 4, "logging_steps": 2,
        "save_strategy": "no", "report_to": [], "use_cpu": True, "seed": 0, "data_seed": 0,
        "dataloader_num_workers": 0, "disable_tqdm": True, **kwargs})
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(24), callbacks=callbacks)


class TruthCallback(transformers.TrainerCallback):
    """Registers :class:`Truths` on the optimizer the Trainer steps, at the start of training."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.truths = Truths(inner(optimizer), model)


def hf_run(tmp_path: Path, monitored: bool, config: MonitorConfig | None = None, **kwargs):
    from monitored_optim.hf import MonitorCallback

    truth = TruthCallback()
    trainer = hf_trainer(tmp_path, [MonitorCallback(config), truth] if monitored else [truth], **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Trainer's own notices (tokenizer-free model, cpu)
        trainer.train()
    return trainer, truth.truths.steps


def test_hf_default_optimizer_logs_to_the_trainers_tensorboard_at_its_logging_steps(tmp_path, monkeypatch):
    monkeypatch.delenv("MONITORED_OPTIM_EVERY")  # the Trainer's logging_steps sets the period
    plain, _ = hf_run(tmp_path / "plain", False)
    trainer, truths = hf_run(tmp_path / "monitored", True, report_to=["tensorboard"])
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), trainer.model.parameters()))
    opt = inner(trainer.optimizer)
    assert opt.monitor.step == trainer.state.global_step == 6
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["weight_decay"] == 0.0  # the Trainer's groups
    rows = read_tensorboard(tmp_path / "monitored" / "runs")
    assert len({p.parent for p in (tmp_path / "monitored" / "runs").rglob("events.*")}) == 1  # beside the Trainer's
    logged = {step: monitor_figures(row) for step, row in rows.items() if monitor_figures(row)}
    assert sorted(logged) == [2, 4, 6]
    assert all("train/loss" in rows[step] for step in (2, 4, 6))  # the Trainer's figures at the same steps
    for step, row in logged.items():
        assert_figures_match(row, truths[step - 1])


def test_hf_report_to_none_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITORED_OPTIM_BACKEND", "jsonl")
    monkeypatch.setenv("MONITORED_OPTIM_LOGDIR", str(tmp_path / "env"))
    trainer, truths = hf_run(tmp_path / "out", True)
    rows = [json.loads(line) for line in (tmp_path / "env" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.parametrize("optim", ["adamw_torch", "adafactor", "sgd", "rmsprop"])
def test_hf_optim_names_are_monitored_with_the_trainers_settings(tmp_path, optim):
    plain, _ = hf_run(tmp_path / "plain", False, optim=optim)
    trainer, truths = hf_run(tmp_path / "monitored", True, MonitorConfig(backend="jsonl", logdir=tmp_path / "logs"),
                             optim=optim)
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), trainer.model.parameters()))
    opt, plain_opt = inner(trainer.optimizer), inner(plain.optimizer)
    assert type(opt).__mro__[1] is type(plain_opt)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in plain_opt.param_groups]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]  # conftest's MONITORED_OPTIM_EVERY=1 wins
    for row in rows:
        assert_figures_match({k: v for k, v in row.items() if not k.startswith(("update_lost/", "step"))},
                             truths[row["step"] - 1])


# ----------------------------------------------------------------------------------------- Lightning

class Regression(lightning.LightningModule):
    """A module the user cannot edit: AdamW with a StepLR in the dict ``configure_optimizers`` returns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
        torch.nn.init.zeros_(self.net[0].bias)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3),
                                                   "interval": "step"}}


class TwoOptimizers(Regression):
    """Manual optimization with two optimizers, one per half of the network (a GAN's two players)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, _):
        x, y = batch
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self.net(x), y))
            opt.step()

    def configure_optimizers(self):
        return [torch.optim.AdamW(self.net[:2].parameters(), lr=1e-2),
                torch.optim.SGD(self.net[2:].parameters(), lr=1e-2, momentum=0.9)]


class LitTruths(lightning.Callback):
    def on_train_start(self, trainer, pl_module):
        self.truths = [Truths(opt, pl_module) for opt in trainer.optimizers]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        next(t for t in self.truths if t.opt is getattr(optimizer, "_optimizer", optimizer)).grads()


def regression(n: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def lit_run(tmp_path: Path, module_cls, monitored: bool, logger, config=None, steps: int = 6):
    from monitored_optim.lightning import MonitorCallback

    module, truth = module_cls(), LitTruths()
    trainer = lightning.Trainer(
        max_steps=steps, logger=logger, accelerator="cpu", devices=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2, default_root_dir=str(tmp_path),
        callbacks=[MonitorCallback(config), truth] if monitored else [truth])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, regression(40))
    told = [str(w.message) for w in seen if "optimizer.step()" in str(w.message) or "monitored_optim" in str(w.message)]
    return module, trainer, truth.truths, told


def test_lightning_unchanged_module_logs_beside_its_tensorboard_logger(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import TensorBoardLogger

    monkeypatch.delenv("MONITORED_OPTIM_EVERY")  # log_every_n_steps sets the period
    plain, *_ = lit_run(tmp_path / "plain", Regression, False, False)
    logger = TensorBoardLogger(str(tmp_path / "tb"), name="lit")
    module, trainer, (truths,), told = lit_run(tmp_path, Regression, True, logger)
    assert told == []  # no word from Lightning or torch that step() was overridden after the scheduler
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), module.parameters()))
    assert trainer.optimizers[0].monitor.step == trainer.global_step == 6
    rows = read_tensorboard(Path(logger.log_dir))
    logged = {step: monitor_figures(row) for step, row in rows.items() if monitor_figures(row)}
    assert sorted(logged) == [2, 4, 6]
    assert any("train_loss" in row for row in rows.values())  # the logger's own figures, same directory
    for step, row in logged.items():
        assert_figures_match(row, truths.steps[step - 1])
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 6  # the scheduler still steps


def test_lightning_two_optimizers_are_kept_apart_in_its_csv_loggers_directory(tmp_path):
    """Two optimizers (manual optimization) under their class names after the configuration's prefix,
    in the CSV logger's directory, each one's figures its own clone truth."""
    from lightning.pytorch.loggers import CSVLogger

    plain, *_ = lit_run(tmp_path / "plain", TwoOptimizers, False, False)
    logger = CSVLogger(str(tmp_path / "csv"), name="lit")
    # a configuration that sets only a prefix keeps the logger's destination
    module, trainer, truths, told = lit_run(tmp_path, TwoOptimizers, True, logger, MonitorConfig(prefix="gan"))
    assert trainer.global_step == 6 and [opt.monitor.step for opt in trainer.optimizers] == [3, 3]
    assert told == []
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), module.parameters()))
    rows = [json.loads(line) for line in (Path(logger.log_dir) / "metrics.jsonl").read_text().splitlines()]
    for prefix, names, truth in (("gan.AdamW/", ("net.0.", "net.1."), truths[0]),
                                 ("gan.SGD/", ("net.2.",), truths[1])):
        own = [{k[len(prefix):]: v for k, v in row.items() if k.startswith(prefix)} for row in rows]
        own = [row for row in own if row]
        assert len(own) == 3 and all(k.split("/", 1)[1].startswith(names) for row in own for k in row
                                     if k.startswith("update_norm/"))
        for step, row in enumerate(own, 1):
            assert_figures_match(row, truth.steps[step - 1])


# ---------------------------------------------------------------------------- stopping on what it sees

def test_hf_trainer_stops_at_the_guards_stall_with_the_weights_of_the_steps_taken(tmp_path):
    """A NaN put into a grad from step 3 on: the guard skips steps 3 and 4 (budget 1), asks to stop, and
    the callback stops the Trainer there; the weights are bit for bit those of a plain Trainer stopped
    after step 2, and the monitor is closed."""
    from monitored_optim.hf import MonitorCallback

    class Poison(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step + 1 >= 3:
                next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")

    monitor = MonitorCallback(MonitorConfig(backend="jsonl", logdir=tmp_path / "logs", guard="nonfinite",
                                            skip_budget=1))
    trainer = hf_trainer(tmp_path, [monitor, Poison()], max_steps=20, max_grad_norm=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Trainer's own notices (tokenizer-free model, cpu)
        trainer.train()
    assert trainer.state.global_step == 4
    assert monitor.monitor.should_stop and monitor.monitor._guard.skipped == 2 and monitor.monitor.step == 2
    assert monitor.monitor._delivery.backends._open is None  # closed at the end of training

    class StopAfterTwo(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 2

    plain = hf_trainer(tmp_path / "plain", [StopAfterTwo()], max_steps=20, max_grad_norm=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain.train()
    assert plain.state.global_step == 2
    for (name, p), q in zip(trainer.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(p, q), name


def test_lightning_trainer_stops_at_the_step_an_event_asks_to(tmp_path):
    """Lightning steps through a closure: the guard runs it, then decides. A NaN from step 3 on, a budget
    of 2: steps 3, 4, 5 skipped, the stop at step 5, the weights those of a plain run of 2 steps."""
    from lightning.pytorch.loggers import CSVLogger

    from monitored_optim.lightning import MonitorCallback

    class Poison(lightning.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step + 1 >= 3:
                pl_module.net[0].weight.grad[0, 0] = float("nan")

    callback = MonitorCallback(MonitorConfig(guard="nonfinite", skip_budget=2))
    trainer = lightning.Trainer(
        max_steps=20, logger=CSVLogger(str(tmp_path), name="lit"), accelerator="cpu", devices=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2,
        default_root_dir=str(tmp_path), callbacks=[callback, Poison()])
    module = Regression()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notices (few workers, cpu)
        trainer.fit(module, regression(100))
    (monitor,) = callback.monitors
    assert monitor.should_stop and monitor._guard.skipped == 3 and monitor.step == 2
    assert trainer.global_step == 5  # Lightning counts the calls
    plain, twin = lightning.Trainer(
        max_steps=2, logger=False, accelerator="cpu", devices=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path)), Regression()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain.fit(twin, regression(100))
    for (name, p), q in zip(module.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name  # the two steps taken, bit for bit

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
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.steps: list[dict[str, float]] = []
        self._before = None
        opt.register_step_pre_hook(self._pre)
        opt.register_step_post_hook(self._post)

    def _pre(self, *_):
        self._before = snapshot(self.named)

    def _post(self, *_):
        self.steps.append(figures(self.named, *self._before))


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

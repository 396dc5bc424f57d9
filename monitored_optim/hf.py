"""The Hugging Face Trainer's callback: ``Trainer(..., callbacks=[MonitorCallback()])``.

It monitors the optimizer the Trainer steps, whichever built it: the Trainer's default AdamW and
its decay groups, any ``optim=``, a subclass's (TRL's trainers), accelerate's wrapper, or
DeepSpeed's from a config's ``"optimizer"`` section; the optimizer's settings stay the Trainer's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import transformers

from .attach import attach_at, monitor_of
from .monitor import Monitor
from .config import ENV_LOGDIR, MonitorConfig
from .trainers import config_for

REPORT_TO = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio",
             "swanlab": "swanlab", "comet_ml": "comet"}
"""``TrainingArguments.report_to`` names -> the monitor's backends (the others have none)."""


class MonitorCallback(transformers.TrainerCallback):
    """Monitor the optimizer the Trainer built, from the start of training.

    Example::

        trainer = transformers.Trainer(model=model, args=args, train_dataset=train,
                                       callbacks=[MonitorCallback()])
        trainer.train()
        trainer.optimizer.optimizer.monitor.latest   # the torch optimizer inside accelerate's wrapper

    With no ``config``, the figures go where ``args.report_to`` sends the Trainer's (TensorBoard in
    the Trainer's logging directory, or the W&B, MLflow, trackio, SwanLab or Comet run it opened;
    none there: ``MONITORED_OPTIM_BACKEND``, else TensorBoard, in ``MONITORED_OPTIM_LOGDIR``, else
    the Trainer's ``runs/`` directory), on the steps the Trainer logs (``logging_steps``, unless
    ``MONITORED_OPTIM_EVERY`` is set). The x axis is the optimizer step, the Trainer's ``global_step``.

    After each optimizer step, a monitor that should stop (``MonitorConfig.stop_on``, or the guard
    past its ``skip_budget``) stops training (``control.should_training_stop``, on every rank at
    the same step); the monitor is closed when training ends.

    Args:
        config: a :class:`~monitored_optim.config.MonitorConfig`; the fields it sets win, the
            Trainer's (``backend``, ``logdir``, ``every``, ``model``) fill those it leaves unset.
    """

    def __init__(self, config: MonitorConfig | None = None) -> None:
        self.config = config
        self.monitor: Monitor | None = None  # the monitor of the optimizer of the training run

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None and self.monitor.should_stop:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if optimizer is None:
            return
        backends = [REPORT_TO[name] for name in args.report_to or [] if name in REPORT_TO]
        beside = "tensorboard" in backends or not (backends or os.environ.get(ENV_LOGDIR))
        logdir = tensorboard_dir(args) if beside else None
        every = state.logging_steps if args.logging_strategy == "steps" else None
        attached = attach_at(optimizer, config_for(self.config, model, backends, logdir, every), state.global_step)
        self.monitor = monitor_of(attached)


def tensorboard_dir(args: Any) -> str:
    """The directory the Trainer's TensorBoard callback writes to: ``TENSORBOARD_LOGGING_DIR``, else the
    newest ``runs/<time>_<host>`` under ``args.output_dir`` (that callback makes it at the start of
    training, before this one runs), else a new one there."""
    if os.environ.get("TENSORBOARD_LOGGING_DIR"):
        return os.path.expanduser(os.environ["TENSORBOARD_LOGGING_DIR"])
    runs = [p for p in Path(args.output_dir, "runs").glob("*") if p.is_dir()]
    if runs:
        return str(max(runs, key=lambda p: p.stat().st_mtime))
    from transformers.integrations.integration_utils import default_logdir

    return os.path.join(args.output_dir, default_logdir())

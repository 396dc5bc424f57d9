"""Lightning's callback: ``Trainer(callbacks=[MonitorCallback()])``, the LightningModule unchanged.

It monitors every optimizer ``configure_optimizers`` returned (an optimizer, lists, the dict with an
``lr_scheduler``), once the Trainer has built them, its schedulers and restored a checkpoint.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from .attach import attach_at, monitor_of
from .monitor import Monitor
from .config import MonitorConfig
from .trainers import config_for, prefixes


class MonitorCallback(pl.Callback):
    """Monitor the optimizers the Trainer built, from the start of training.

    Example::

        trainer = lightning.Trainer(max_steps=1000, callbacks=[MonitorCallback()])
        trainer.fit(module)
        trainer.optimizers[0].monitor.latest

    With no ``config``, the figures go where the Trainer's logger writes: ``TensorBoardLogger``'s
    ``log_dir`` (TensorBoard), ``CSVLogger``'s (``metrics.jsonl`` beside its ``metrics.csv``),
    ``WandbLogger``'s run, ``MLFlowLogger``'s run; no such logger: the ``MONITORED_OPTIM_*``
    environment, else the defaults. They log every ``log_every_n_steps`` optimizer steps (unless
    ``MONITORED_OPTIM_EVERY`` is set). The x axis is the optimizer step, the Trainer's
    ``global_step`` with one optimizer.
    Several optimizers are kept apart by a tag prefix each: the class name, then ``-1``, ``-2``, ...
    for the same class again (as ``LearningRateMonitor`` names them).

    After each training batch, a monitor that should stop (``MonitorConfig.stop_on``, or the guard
    past its ``skip_budget``) stops the Trainer (``trainer.should_stop``, on every rank at the same
    step); the monitors are closed when training ends.

    Args:
        config: a :class:`~monitored_optim.config.MonitorConfig` for every optimizer; the fields it
            sets win, the Trainer's (``backend``, ``logdir``, ``every``, the module as ``model``)
            fill those it leaves unset, and each optimizer's prefix is added after its own.
    """

    def __init__(self, config: MonitorConfig | None = None) -> None:
        self.config = config
        self.monitors: list[Monitor] = []  # those of the optimizers of the training run

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if any(monitor.should_stop for monitor in self.monitors):
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for monitor in self.monitors:
            monitor.close()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        backends, logdir = destination(trainer)
        optimizers = list(trainer.optimizers)
        steps = trainer.global_step if len(optimizers) == 1 else None
        self.monitors = []
        watched = pl_module if len(optimizers) == 1 else None  # one of several holds part of the model
        for opt, prefix in zip(optimizers, prefixes(optimizers)):
            every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning's logger connector
            config = config_for(self.config, watched, backends, logdir, every, prefix)
            self.monitors.append(monitor_of(attach_at(opt, config, steps, pl_module)))


def destination(trainer: pl.Trainer) -> tuple[list[Any], str | None]:
    """The backends (names, or an ``MlflowBackend`` of an ``MLFlowLogger``'s run) and log directory of
    the Trainer's loggers that the monitor can write beside."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    backends: list[Any] = []
    logdir: str | None = None
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            backends.append("tensorboard")
            logdir = logdir or logger.log_dir
        elif isinstance(logger, CSVLogger):
            backends.append("jsonl")
            logdir = logdir or logger.log_dir
        elif isinstance(logger, WandbLogger):
            logger.experiment  # noqa: B018 (opens the logger's run, which the monitor's W&B backend reuses)
            backends.append("wandb")
        elif isinstance(logger, MLFlowLogger):
            from .backends.mlflow import MlflowBackend

            backends.append(MlflowBackend(run_id=logger.run_id, client=logger.experiment))
    return backends, logdir

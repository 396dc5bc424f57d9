"""Weights & Biases backend: the active ``wandb.run`` if there is one, else a run of our own."""

from __future__ import annotations

import os
from pathlib import Path

import wandb


class WandbBackend:
    """Logs each step's figures with ``run.log(metrics, step=step)``: W&B's x axis is the optimizer step.

    An active ``wandb.run`` (the user's) is reused and left open at ``close``; otherwise
    ``wandb.init()`` starts a run configured by W&B's own ``WANDB_*`` variables (``WANDB_PROJECT``,
    ``WANDB_MODE=offline``, ...) and ``close`` finishes it. Its files go to ``WANDB_DIR`` when that
    is set, else under ``logdir`` (``<logdir>/wandb/``), next to the other backends' files.
    """

    def __init__(self, logdir: Path) -> None:
        self._owned = wandb.run is None
        self._run = wandb.init(dir=None if os.environ.get("WANDB_DIR") else str(logdir)) if self._owned else wandb.run

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        if self._owned and self._run is not None:
            self._run.finish()
        self._run = None

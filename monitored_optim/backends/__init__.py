"""Where figures go: one tiny protocol, one module per backend.

A backend receives, at each logging step, a flat ``dict[str, float]`` of finite figures keyed by
tag (``update_to_data/fc1.weight``, ``global/grad_norm``, ...) and the optimizer step (an int >= 1)
that is the x axis. Modelled on torchtitan's ``BaseLogger.log(metrics, step)`` / ``close()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Backend(Protocol):
    """A sink for figures: ``log`` once per logging step, ``close`` once at the end."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (tag -> finite float) at optimizer step ``step`` (int >= 1)."""

    def close(self) -> None:
        """Flush everything written so far and release files or runs; idempotent."""


def open_backend(name: str, logdir: Path) -> Backend:
    """Construct the backend called ``name`` (one of ``config.BACKENDS``) writing under ``logdir``.

    Raises:
        ValueError: unknown ``name``.
        ImportError: the backend's package is missing (``pip install 'monitored_optim[wandb]'``).
    """
    if name == "tensorboard":
        from .tensorboard import TensorBoardBackend

        return TensorBoardBackend(logdir)
    if name == "wandb":
        from .wandb import WandbBackend

        return WandbBackend()
    if name == "jsonl":
        from .jsonl import JsonlBackend

        return JsonlBackend(logdir)
    raise ValueError(f"unknown backend {name!r}")

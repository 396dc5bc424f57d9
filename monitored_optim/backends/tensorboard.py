"""TensorBoard backend through tensorboardX's ``SummaryWriter`` (one scalar per tag)."""

from __future__ import annotations

from pathlib import Path

from tensorboardX import SummaryWriter


class TensorBoardBackend:
    """Writes each figure as a scalar summary ``tag`` at ``global_step=step`` in ``logdir``.

    Example: ``TensorBoardBackend(Path("runs/exp1")).log({"global/grad_norm": 0.5}, step=10)``
    writes an event file that ``tensorboard --logdir runs`` shows.
    """

    def __init__(self, logdir: Path, filename_suffix: str = "") -> None:
        self._writer = SummaryWriter(logdir=str(logdir), filename_suffix=filename_suffix)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._writer.close()

"""Weights & Biases backend: the active ``wandb.run`` if there is one, else a run of our own."""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any, cast

import wandb
from wandb.sdk.wandb_alerts import AlertLevel

from ..histograms import Histogram
from .bins import as_bins
from .names import STEP_METRIC, Families


class WandbBackend:
    """Logs each step's figures as one row, ``run.log({**metrics, "optimizer/step": step})``.

    The optimizer step is the x axis of the monitor's figures through W&B's convention for several
    x axes: ``define_metric("optimizer/step")`` and ``define_metric("<family>/*",
    step_metric="optimizer/step")`` for each family of tags (``update_to_data``, ``global``, ...,
    or the monitor's ``prefix``). No ``step=`` is passed, so a run shared with the Hugging Face
    Trainer, Lightning's ``WandbLogger`` or the user's own ``wandb.log`` calls never drops a row for
    a step that went backwards, and the run's own ``_step`` stays theirs.

    An active ``wandb.run`` (the user's) is reused and left open at ``close``; otherwise
    ``wandb.init()`` starts a run configured by W&B's own ``WANDB_*`` variables (``WANDB_PROJECT``,
    ``WANDB_MODE=offline``, ...) and ``close`` finishes it and, when no other run is active, shuts
    W&B's service down (``wandb.teardown()``), which returns only when the run's files are complete.
    At interpreter exit without ``close`` (the script's end, an exception, Ctrl-C, ``SystemExit``)
    the run is left to W&B's own exit hook, which finishes it with the process's exit status (255
    after Ctrl-C) and writes every row. Its files go to ``WANDB_DIR/wandb/`` when that is set, else
    to ``<logdir>/wandb/``.
    """

    def __init__(self, logdir: Path) -> None:
        self._owned = wandb.run is None
        self._run: Any  # wandb's Run; None once closed
        if self._owned:
            self._run = wandb.init(dir=None if os.environ.get("WANDB_DIR") else str(logdir))
            atexit.register(self._leave_to_wandb)  # after W&B's own exit hook, so it runs before it
        else:
            self._run = wandb.run
        self._run.define_metric(STEP_METRIC)
        self._families = Families()

    def log(self, metrics: dict[str, float], step: int) -> None:
        for family in self._families.new(metrics):
            self._run.define_metric(f"{family}/*", step_metric=STEP_METRIC)
        self._run.log({**metrics, STEP_METRIC: step})

    def histograms(self, hists: dict[str, Histogram], step: int) -> None:
        """Log one row of ``wandb.Histogram`` per non-empty tag (its non-empty span drawn from its exact
        min to its exact max, :func:`as_bins`; at most 115 of W&B's 512 bins), with
        ``optimizer/step`` as the scalars' rows. W&B's histogram holds no sums."""
        # cast: wandb.Histogram takes lists as well as the arrays its hint names
        shown = {tag: wandb.Histogram(np_histogram=cast(Any, bins)) for tag, bins in as_bins(hists).items()}
        for family in self._families.new(shown):
            self._run.define_metric(f"{family}/*", step_metric=STEP_METRIC)
        self._run.log({**shown, STEP_METRIC: step})

    def alert(self, title: str, text: str, level: int) -> None:
        """``run.alert(title, text, level)``: W&B's alert (an email or Slack message, as the user's W&B
        settings say), at ``WARN`` or ``ERROR`` for ``logging.WARNING`` or ``logging.ERROR``."""
        self._run.alert(title=title, text=text,
                        level=AlertLevel.ERROR if level >= logging.ERROR else AlertLevel.WARN)

    def close(self) -> None:
        run, self._run = self._run, None
        if self._owned and run is not None:
            atexit.unregister(self._leave_to_wandb)
            run.finish()
            if wandb.run is None:
                wandb.teardown()

    def _leave_to_wandb(self) -> None:
        """Hand the run to W&B at interpreter exit: a later ``close`` leaves it open, as a user's run.

        W&B's exit hook shuts its service down and finishes the run with the process's exit status;
        a ``run.finish()`` after it would fail on the closed connection."""
        self._owned = False

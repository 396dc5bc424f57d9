"""Comet backend: the running Comet experiment if there is one, else an experiment of our own."""

from __future__ import annotations

import logging
import os
from typing import Any
from pathlib import Path

import comet_ml
from comet_ml.data_structure import Histogram as CometHistogram

from ..histograms import Histogram
from .bins import MIDDLES, check
from .names import Keys, shorten

MAX_KEY = 100
"""The longest metric name Comet keeps (``MAXIMAL_KEY_LENGTH``); it cuts longer ones, with a warning."""


def comet_key(tag: str) -> str:
    """The Comet metric name of a monitor tag: ``tag`` itself (Comet takes any character) up to
    :data:`MAX_KEY` characters; a longer one keeps its beginning and end around 8 hex digits of the
    tag's SHA-1."""
    return shorten(tag, tag, MAX_KEY)


class CometBackend:
    """Logs each step's figures as Comet metrics at the optimizer step.

    Comet keeps one history per metric, each point with its own step, so a trainer's metrics at its
    steps sit beside the figures and none is dropped. Each logging step is one
    ``experiment.log_metrics(figures)`` with the experiment's current step set to the optimizer
    step for that call only: ``curr_step``, the step that the trainer's and Comet's own metrics
    logged without ``step=`` get (system metrics, Lightning's and the Hugging Face Trainer's
    callbacks pass theirs), is put back afterwards.

    The running experiment (``comet_ml.get_running_experiment()``: the user's ``comet_ml.start()``,
    the Hugging Face Trainer's with ``report_to="comet_ml"``, Lightning's ``CometLogger``) is reused
    and left open at ``close``; otherwise ``comet_ml.start()`` starts one configured by Comet's own
    variables (``COMET_START_ONLINE=false`` for an offline experiment, which needs no server or key;
    ``COMET_API_KEY``, ``COMET_PROJECT_NAME``, ...), and ``close`` ends it, which writes an offline
    experiment's archive (at interpreter exit without ``close``, the monitor's exit hook ends it).
    An offline archive goes to ``COMET_OFFLINE_DIRECTORY`` when that is set, else to
    ``<logdir>/cometml/``.

    Example: ``CometBackend(Path("runs/exp1")).log({"global/grad_norm": 0.5}, step=10)``.

    Raises:
        ValueError: an online experiment without an API key (Comet's own error).
    """

    def __init__(self, logdir: Path) -> None:
        running = comet_ml.get_running_experiment()
        self._owned = running is None or not running.alive  # an ended experiment stays "running"
        if self._owned:
            directory = None if os.environ.get("COMET_OFFLINE_DIRECTORY") else logdir / "cometml"
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)  # Comet refuses a directory it cannot find
            running = comet_ml.start(experiment_config=comet_ml.ExperimentConfig(
                offline_directory=None if directory is None else str(directory)))
        assert running is not None  # started, or the running one (not owned)
        self._experiment: Any = running  # comet_ml's hints type curr_step None; None once closed
        self._key = Keys(comet_key, MAX_KEY)

    def log(self, metrics: dict[str, float], step: int) -> None:
        experiment = self._experiment
        current, experiment.curr_step = experiment.curr_step, step
        try:
            experiment.log_metrics(self._key.rename(metrics))
        finally:
            experiment.curr_step = current

    def histograms(self, hists: dict[str, Histogram], step: int) -> None:
        """Log each non-empty histogram with ``log_histogram_3d`` at ``step`` (Comet's *Histograms* panel).

        Comet's histogram has bins of its own (ratio 1.1 from 1e-12, ``comet_ml.data_structure.Histogram``),
        taking values with counts: each bin's count goes in as that many elements at the bin's middle
        (:data:`~.bins.MIDDLES`), so every count is kept, in the Comet bin of that middle (Comet's
        histogram takes no min, max or sums).
        """
        for tag, counts in hists.items():
            check(counts)
            kept = [(middle, int(c)) for middle, c in zip(MIDDLES, counts) if c]
            if kept:
                histogram = CometHistogram()
                histogram.add([middle for middle, _ in kept], counts=[c for _, c in kept])
                self._experiment.log_histogram_3d(histogram, name=self._key(tag), step=step)

    def alert(self, title: str, text: str, level: int) -> None:
        """``send_notification(title, status, {"text": text})``: Comet's e-mail to the experiment's owner,
        with the status ``"warning"`` or ``"error"`` for ``logging.WARNING`` or ``logging.ERROR``."""
        self._experiment.send_notification(title, status="error" if level >= logging.ERROR else "warning",
                                           additional_data={"text": text})

    def close(self) -> None:
        experiment, self._experiment = self._experiment, None
        if self._owned and experiment is not None and experiment.alive:
            experiment.end()

"""trackio backend: the current trackio run if there is one, else a run of our own."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import trackio
from trackio import context_vars

from ..histograms import Histogram
from .bins import as_bins
from .names import Keys

DEFAULT_PROJECT = "monitored_optim"
"""The project of a run the backend starts when ``TRACKIO_PROJECT`` is not set."""

_RESERVED = re.compile(r"^_{2,}")
"""A start trackio renames (with a warning at every row): keys beginning with ``__``."""


def trackio_key(tag: str) -> str:
    """The trackio metric name of a monitor tag: ``tag`` itself, as trackio stores any name in its
    database, except that a leading ``__`` (a ``prefix`` that starts so) becomes ``_``."""
    return _RESERVED.sub("_", tag)


class TrackioBackend:
    """Logs each step's figures as one trackio row at the optimizer step.

    A trackio row has one step, the x axis of its dashboard, so the row is ``run.log(figures,
    step=step)``. The run's own step counter (the step of a row logged without ``step=``, as the
    Hugging Face Trainer's callback logs, carrying ``train/global_step``) is put back after each
    row, so the trainer's rows keep the steps they have without the monitor. trackio keeps every
    row, in any order of steps, and writes them to its database from its own thread, which reports
    its own failures (once, as warnings) and never stops the caller.

    The current run (the user's ``trackio.init()``, the Hugging Face Trainer's with
    ``report_to="trackio"``) is reused and left open at ``close``; otherwise ``trackio.init()``
    starts one in the project ``TRACKIO_PROJECT`` (default ``monitored_optim``), stored where
    trackio's own variables say (``TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``;
    ``TRACKIO_SPACE_ID``, ``TRACKIO_SERVER_URL``), and ``close`` finishes it (at interpreter exit
    without ``close``, the monitor's exit hook or trackio's own finishes it, flushing every row).

    Example: ``TrackioBackend().log({"global/grad_norm": 0.5}, step=10)``.
    """

    def __init__(self) -> None:
        current = context_vars.current_run.get()
        self._owned = current is None
        self._run: Any = trackio.init(project=os.environ.get("TRACKIO_PROJECT") or DEFAULT_PROJECT,
                                 embed=False) if current is None else current
        self._key = Keys(trackio_key, 10_000)

    def log(self, metrics: dict[str, Any], step: int) -> None:  # floats, or histograms()'s trackio.Histogram
        counter = getattr(self._run, "_next_step", None)
        self._run.log(self._key.rename(metrics), step=step)
        if counter is not None:
            self._run._next_step = counter

    def histograms(self, hists: dict[str, Histogram], step: int) -> None:
        """Log one row of ``trackio.Histogram`` per non-empty tag (its non-empty span drawn from its exact
        min to its exact max, :func:`as_bins`) at ``step``, as :meth:`log` logs the figures."""
        self.log({tag: trackio.Histogram(np_histogram=bins) for tag, bins in as_bins(hists).items()}, step)

    def alert(self, title: str, text: str, level: int) -> None:
        """``run.alert(title, text, level)``: trackio's alert (printed, stored with the run, shown on its
        dashboard, and sent to the run's webhook if it has one), at ``WARN`` or ``ERROR``."""
        self._run.alert(title=title, text=text,
                        level=trackio.AlertLevel.ERROR if level >= logging.ERROR else trackio.AlertLevel.WARN)

    def close(self) -> None:
        run, self._run = self._run, None
        if self._owned and run is not None:
            run.finish()
            if context_vars.current_run.get() is run:
                context_vars.current_run.set(None)

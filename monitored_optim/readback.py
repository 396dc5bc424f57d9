"""What a monitor shows of its run in a notebook: its plan, its in-memory history, the report's figure and table.

``ReadBack`` is the part of :class:`~monitored_optim.monitor.Monitor` that reads back (it
uses the monitor's ``_models``, ``_delivery``, ``_engine`` and ``settings``); none of it
runs during a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .histograms import Histogram

if TYPE_CHECKING:

    from .config import Settings
    from .deliver import Delivery
    from .engine import Engine
    from .models import Models


class ReadBack:
    """``latest``, ``histograms``, ``describe()``, ``history()``, ``plot()`` and ``report()`` of ``opt.monitor``."""

    # set by the Monitor's __init__ (this class is its part that reads back)
    settings: Settings
    _delivery: Delivery
    _models: Models
    _engine: Engine

    @property
    def latest(self) -> dict[str, float]:
        """Tag -> value of the last logging step (empty before it)."""
        return self._delivery.latest

    @property
    def histograms(self) -> dict[str, Histogram]:
        """Tag (``update_hist/{name}``, ``grad_hist/{name}``, ``param_hist/{name}``) -> the histogram of
        the last logging step: the counts in the bins of :mod:`monitored_optim.histograms` (a list of
        ``NBINS`` ints) with the exact ``min``, ``max``, ``sum`` and ``sum_squares`` of the finite
        elements (:class:`~monitored_optim.histograms.Histogram`); empty unless
        ``MonitorConfig(figures=...)`` turns the ``histograms`` family on."""
        return self._delivery.histograms

    def describe(self) -> str:
        """What will be measured, for ``print``: the param groups and their hyperparameters, then
        each parameter's name, shape, dtype, kind and how it is captured and why
        (:func:`monitored_optim.describe.describe`).

        Raises:
            RuntimeError: the optimizer this monitor belongs to no longer exists.
        """
        from .describe import describe

        optimizer = self._engine.optimizer
        if optimizer is None:
            raise RuntimeError("monitored_optim: the optimizer of this monitor no longer exists")
        return describe(self._engine, optimizer, self._models.names)

    def history(self) -> Any:
        """The figures of the logging steps kept in memory, as a pandas ``DataFrame``.

        One row per logging step (index ``step``), one float32 column per tag, NaN where a step did
        not log it.

        Bounded (``monitored_optim.history``): at most 4,194,304 values (16 MiB) in rows evenly
        spaced over the whole run, and the last logging step.

        Raises:
            ImportError: pandas is not installed (``pip install 'monitored_optim[notebook]'``).
        """
        return self._delivery.history.frame()

    def plot(self, params: str | None = None) -> Any:
        """The report's update-to-data figure of this run, from memory, as a matplotlib ``Figure``.

        Jupyter shows it inline; ``fig.savefig("u.png")`` writes it (``monitored_optim.report.draw_run``).
        ``params``: a glob on parameter names (default: the report's choice of matrices).

        Raises:
            ReportError: nothing logged yet, matplotlib is missing, or ``params`` matches no parameter.
        """
        from .report.plot import draw_run

        return draw_run(self._run(), params=params)

    def report(self, last: int = 20) -> Any:
        """The report table of this run, from memory, as a ``monitored_optim.report.Summary``.

        Medians cover the ``last`` logging steps (int >= 1); Jupyter renders it as the table and
        ``print`` as text.

        Raises:
            ReportError: nothing logged yet.
        """
        from .report.summary import summarize

        return summarize(self._run(), last)

    def _run(self) -> Any:
        """The history as the report's ``Run``, named after the optimizer's class; kinds from the
        shapes the logging steps delivered (the optimizer may be gone, its parameters renamed)."""
        from pathlib import Path

        import torch

        from .describe import kind

        optimizer = self._engine.optimizer
        kinds = {label: kind(torch.Size(shape)) for label, shape in self._delivery.shapes.items()}
        label = type(optimizer).__name__ if optimizer is not None else "run"
        return self._delivery.history.run(Path(self.settings.prefix + label), kinds)

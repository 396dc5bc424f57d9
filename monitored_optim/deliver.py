"""The last stage of a logging step: its figures to ``latest``, the in-memory history and the backends.

Every rank keeps ``latest`` and the history; under ``torch.distributed`` only rank 0 writes
``params.json`` and opens the backends. A logging step with more tags than the tag budget goes to
the dashboards grouped by depth (:mod:`monitored_optim.grouping`).
"""

from __future__ import annotations

import atexit
import functools
import weakref
from typing import TYPE_CHECKING

from . import distributed, grouping
from ._warnings import Once, warn
from .backends import FILES, Fanout, make_logdir
from .config import Settings
from .history import History

if TYPE_CHECKING:
    from pathlib import Path

    from .capture.plan import Roster
    from .histograms import Histogram


class Delivery:
    """Where one monitor's figures go.

    Whether this process writes (:func:`~monitored_optim.distributed.is_writer`) is decided once: when
    the monitor is built, or, where ``torch.distributed`` is not set up yet, at its first logging step.
    Building it makes the log directory of a file backend in a process that may write.

    Args:
        settings: the monitor's settings (``prefix``, ``backends``, ``logdir``, ``tag_budget``, ...).

    Attributes:
        latest: ``dict[str, float]``, tag (with the prefix) -> value of the last logging step.
        histograms: ``dict[str, Histogram]``, tag (with the prefix) -> the counts, extremes and sums of
            the last logging step (:class:`~monitored_optim.histograms.Histogram`).
        history: the in-memory history of the logging steps (``monitored_optim.history``).
        shapes: ``dict[str, tuple[int, ...]]``, tag label (with the prefix) -> the whole shape of every
            parameter logged so far, as the last logging step that held it had it.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.latest: dict[str, float] = {}
        self.histograms: dict[str, Histogram] = {}
        self.history = History()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._writes = distributed.is_writer() if distributed.initialized() else None  # else at the first send
        if self._writes is not False:  # another rank never writes: no stray (differently timestamped) dirs
            make_logdir(settings.backends, settings.logdir)
        self.backends = Fanout(settings.backends, settings.logdir, settings.strict, settings.sinks)
        self._described: tuple[Path, tuple[str, ...]] | None = None
        """The run directory and parameters ``params.json`` was last written for."""
        self._told_budget = Once()
        check_shared(settings, [other.settings for other in list(_LIVE)])
        _LIVE.add(self)

    def writes(self) -> bool:
        """Whether this process writes the figures (decided once: see the class docstring)."""
        if self._writes is None:  # built before torch.distributed was set up, if it ever is
            self._writes = distributed.is_writer()
        return self._writes

    def send(self, step: int, figures: dict[str, float], roster: Roster,
             hists: dict[str, Histogram] | None = None) -> None:
        """Make ``figures`` (tags without the prefix) the ``latest`` of ``step`` and record them; on the
        writing rank, write ``params.json`` (in the run directory of the file backends, :mod:`.backends.rundir`) when
        the parameters changed and send them to the backends.

        ``roster``: the step's parameters (``names``, ``shapes``, ``dtypes``); ``hists``: the step's
        histograms, tag (without the prefix) -> histogram (:func:`monitored_optim.histograms.of`), kept
        as ``histograms`` and sent after the figures."""
        prefix = self.settings.prefix
        self.latest = {prefix + tag: value for tag, value in figures.items()} if prefix else figures
        self.histograms = {prefix + tag: counts for tag, counts in (hists or {}).items()}
        self.history.record(step, self.latest)
        self.shapes.update((prefix + name, tuple(shape)) for name, shape in zip(roster.names, roster.shapes))
        _LIVE.add(self)  # again, after a close()
        if not self.writes():  # under torch.distributed only rank 0 opens and writes backends
            return
        where = self.backends.open(step)  # the run directory of the file backends
        if (where, tuple(roster.names)) != self._described and set(FILES) & set(self.settings.backends):
            self._described = (where, tuple(roster.names))
            from .describe import write_shapes

            write_shapes(where / "params.json", prefix, list(zip(roster.names, roster.shapes, roster.dtypes)))
        over = len(self.latest) + len(self.histograms) > self.settings.tag_budget  # a histogram is a tag too
        self.backends.log(self.latest, step, functools.partial(self._grouped, self.latest) if over else None)
        if self.histograms:
            grouped = functools.partial(grouping.summarize_histograms, self.histograms, prefix) if over else None
            self.backends.histograms(self.histograms, step, grouped)

    def alert(self, title: str, text: str, level: int, step: int) -> None:
        """Send an alert of optimizer step ``step`` to the backends that can reach a person, on the
        writing rank (:meth:`~monitored_optim.backends.Fanout.alert`)."""
        if self.writes():
            self.backends.alert(title, text, level, step)

    def _grouped(self, latest: dict[str, float]) -> dict[str, float]:
        """``latest`` grouped by depth for the dashboards (a step over the tag budget); warns once if
        even that is over it."""
        compact = grouping.summarize(latest, self.settings.prefix)
        if len(compact) > self.settings.tag_budget and self._told_budget.first():
            warn(f"monitored_optim: {len(compact)} tags per logging step even grouped by depth, above "
                 f"the tag budget of {self.settings.tag_budget} for TensorBoard, W&B and MLflow; choose what "
                 "is monitored with MonitorConfig(params=..., figures=...) or raise tag_budget")
        return compact

    def close(self) -> None:
        """Flush and close the backends (idempotent)."""
        self.backends.close()
        _LIVE.discard(self)  # a delivery to the same logdir after this one is no clash


_LIVE: weakref.WeakSet[Delivery] = weakref.WeakSet()
"""The deliveries not closed: a new one's settings are checked against theirs; closed at exit."""


@atexit.register
def _close_live() -> None:
    for delivery in list(_LIVE):
        delivery.close()


def check_shared(settings: Settings, others: list[Settings]) -> None:
    """Warn when another live monitor of this process (its ``others`` settings) logs the same tags to
    the same place.

    Two optimizers built in the same second share the default ``runs/<time>_<host>``, and their
    figures would overwrite each other."""
    for same in others:
        if (same.prefix == settings.prefix and set(same.backends) & set(settings.backends)
                and same.logdir.resolve() == settings.logdir.resolve()):
            warn(f"monitored_optim: two monitored optimizers log the same tags to {str(settings.logdir)!r}; "
                 "give each one MonitorConfig(prefix=...) (or its own logdir) to keep their figures apart")
            return

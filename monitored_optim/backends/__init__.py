"""Where figures go: one tiny protocol, one module per backend.

A backend receives, at each logging step, a flat ``dict[str, float]`` of finite figures keyed by
tag (``update_to_data/fc1.weight``, ``global/grad_norm``, ...) and the optimizer step (an int >= 1)
that is the x axis. Modelled on torchtitan's ``BaseLogger.log(metrics, step)`` / ``close()``.
"""

from __future__ import annotations

import itertools
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .._warnings import Once, warn
from . import rundir

if TYPE_CHECKING:
    from ..histograms import Histogram


class Backend(Protocol):
    """A sink for figures: ``log`` once per logging step, ``close`` once at the end.

    A backend that shows histograms also has ``histograms(hists, step)`` (tag -> a
    :class:`~monitored_optim.histograms.Histogram`: the counts of the fixed bins, the exact min,
    max, sum and sum of squares), called after ``log`` on the logging steps
    that have them; one that cannot may say why in a class attribute ``NO_HISTOGRAMS``."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (tag -> finite float) at optimizer step ``step`` (int >= 1)."""

    def close(self) -> None:
        """Flush everything written so far and release files or runs; idempotent."""


def open_backend(name: str, logdir: Path) -> Backend:
    """Construct the backend called ``name`` (one of ``config.BACKENDS``) writing under ``logdir``.

    Raises:
        ValueError: unknown ``name``.
        ImportError: the backend's package is missing (``pip install 'monitored_optim[comet]'``, ...).
    """
    if name == "tensorboard":
        from .tensorboard import TensorBoardBackend

        return TensorBoardBackend(logdir, filename_suffix=f".{os.getpid()}.{next(_WRITERS):06d}")
    if name == "wandb":
        from .wandb import WandbBackend

        return WandbBackend(logdir)
    if name == "jsonl":
        from .jsonl import JsonlBackend

        return JsonlBackend(logdir)
    if name == "mlflow":
        from .mlflow import MlflowBackend

        return MlflowBackend()
    if name == "trackio":
        from .trackio import TrackioBackend

        return TrackioBackend()
    if name == "swanlab":
        from .swanlab import SwanlabBackend

        return SwanlabBackend(logdir)
    if name == "comet":
        from .comet import CometBackend

        return CometBackend(logdir)
    raise ValueError(f"unknown backend {name!r}")


PACKAGES = {"tensorboard": ("tensorboardX", None), "wandb": ("wandb", "wandb"), "jsonl": (None, None),
            "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio"), "swanlab": ("swanlab", "swanlab"),
            "comet": ("comet_ml", "comet")}
"""Backend -> (the module it imports, the extra that installs it)."""


def check_installed(names: tuple[str, ...]) -> None:
    """Fail at construction for a backend whose package is missing.

    Raises:
        ImportError: naming the backend, its package and the extra that installs it.
    """
    import importlib.util

    for name in names:
        module, extra = PACKAGES[name]
        if module and importlib.util.find_spec(module) is None:
            how = f"pip install 'monitored_optim[{extra}]'" if extra else f"pip install {module}"
            raise ImportError(f"monitored_optim backend {name!r} needs the {module} package: {how}")


def make_logdir(names: tuple[str, ...], logdir: Path) -> None:
    """Create the log directory of the file backends among ``names`` now, so that a bad path fails at
    construction.

    Raises:
        OSError: naming the directory and why it cannot be created.
    """
    if not set(FILES) & set(names):
        return
    try:
        logdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"monitored_optim cannot create the log directory {str(logdir)!r}: "
                      f"{err.strerror or err}") from err


_WRITERS = itertools.count()
"""Numbers the event files of one process: two writers in one logdir never share a file, and, zero-padded,
their names sort in the order they were made (TensorBoard reads a run directory's files in name order and
shows the custom-scalars layout it read last, the one of the writer made last, which holds every chart)."""


FILES = ("tensorboard", "jsonl")
"""The backends that write files in a run directory of the logdir (:mod:`.rundir`: which one)."""

GROUPED = ("tensorboard", "wandb", "mlflow", "trackio", "swanlab", "comet")
"""The backends that get a logging step over the tag budget grouped by depth (dashboards)."""


class Fanout:
    """The backends of one monitor: opened at the first ``log``, each guarded against failure.

    The file backends write in the run directory that :mod:`.rundir` chooses in the logdir when they are
    opened (the logdir itself, unless it holds another run), which the process holds locked until ``close``
    (or the Fanout's collection).

    A backend that raises (in its constructor, ``log`` or ``close``: a full disk is ``OSError``
    ENOSPC, a file-size limit EFBIG) is reported once with ``warnings.warn`` naming it and the
    error, closed (quietly: its files and runs are released) and dropped, and training goes on;
    with ``strict=True`` the exception propagates instead.

    Args:
        names: backend names from ``config.BACKENDS`` (may be empty).
        logdir: directory for file-based backends.
        strict: raise instead of warning and dropping.
        sinks: the user's own sinks (objects with ``log(metrics, step)``, or callables
            ``fn(metrics, step)``), which get every figure, as ``metrics.jsonl`` does; a backend
            object whose class has a ``NAME`` of :data:`GROUPED` (an ``MlflowBackend`` of a given
            run) is that backend, already made.
    """

    def __init__(self, names: tuple[str, ...], logdir: Path, strict: bool, sinks: tuple[Any, ...] = ()) -> None:
        self.made = {sink.NAME: sink for sink in sinks if getattr(type(sink), "NAME", None) in GROUPED}
        self.names = tuple(name for name in names if name not in self.made)  # the one given is that backend
        self.logdir, self.strict = logdir, strict
        self.sinks = {_sink_name(sink, i): sink for i, sink in enumerate(sinks) if sink not in self.made.values()}
        self._open: dict[str, Backend] | None = None
        self.where = logdir
        """The run directory the file backends write in (:meth:`open`)."""
        self._release: weakref.finalize | None = None
        self._told = Once()
        self._mute: set[str] = set()  # backends whose alert call failed

    def log(self, metrics: dict[str, float], step: int,
            compact: Callable[[], dict[str, float]] | None = None) -> None:
        """Send ``metrics`` at ``step`` to every working backend, opening them the first time.

        ``compact``, when given, makes what goes to the dashboards (:data:`GROUPED`) instead (the figures grouped
        by depth, for a step over the tag budget), called once and only where one of them is open;
        ``metrics.jsonl`` and the user's sinks always get ``metrics``."""
        self._send("log", metrics, step, compact)

    def histograms(self, hists: dict[str, Histogram], step: int,
                   compact: Callable[[], dict[str, Histogram]] | None = None) -> None:
        """Send the histograms of ``step`` to every working backend that shows histograms.

        Args:
            hists: tag (``[prefix/]update_hist/fc1.weight``, ``grad_hist/...``, ``param_hist/...``)
                -> its :class:`~monitored_optim.histograms.Histogram`: the counts of the
                :data:`~monitored_optim.histograms.NBINS` fixed bins (ints), the exact min, max, sum
                and sum of squares.
            step: the optimizer step, as in the :meth:`log` of the same logging step just before.
            compact: as :meth:`log`'s: makes the histograms grouped by depth
                (:func:`~monitored_optim.grouping.summarize_histograms`) for the dashboards
                (:data:`GROUPED`); ``histograms.jsonl`` and the user's sinks get ``hists``.

        A backend without a histogram type (MLflow, SwanLab) is warned about once and skipped; a user's
        sink gets ``sink.histograms(hists, step)`` only if it has that method (silently otherwise).
        A backend that fails here is dropped as in :meth:`log`.
        """
        self._send("histograms", hists, step, compact)

    def alert(self, title: str, text: str, level: int, step: int) -> None:
        """``backend.alert(title, text, level)`` on every open backend that has it (W&B, trackio,
        Comet, a user's sink with an ``alert`` method), opening them the first time (at ``step``, the
        optimizer step of the alert, as :meth:`open`); ``level`` is ``logging.WARNING`` or
        ``logging.ERROR``. One that fails is warned about once and gets no more alerts; its figures
        still go to it (``strict``: the exception propagates)."""
        self.open(step)
        assert self._open is not None  # opened just now
        for name, backend in list(self._open.items()):
            action = getattr(backend, "alert", None)
            if action is not None and name not in self._mute and self._guard(name, action, title, text, level,
                                                                              what="alerts") is _FAILED:
                self._mute.add(name)

    def open(self, step: int) -> Path:
        """Open the backends, if they are not open, for a run whose first logging step is ``step``; the run
        directory the file backends write in (:func:`.rundir.claim`: the logdir, unless it holds another run).

        Example: ``Fanout(("jsonl",), Path("runs/exp1"), strict=False).open(10)`` is ``runs/exp1``, or
        ``runs/exp1/run2`` where ``runs/exp1/metrics.jsonl`` already holds step 10 or later.
        """
        if self._open is None:
            self.where = self.logdir
            if set(FILES) & set(self.names):
                self.where = rundir.claim(self.logdir, step)
                self._release = weakref.finalize(self, rundir.release, self.logdir)
            opened = {name: self._guard(name, open_backend, name, self.where if name in FILES else self.logdir)
                      for name in self.names}
            self._open = {name: backend for name, backend in opened.items() if backend is not _FAILED}
            self._open.update(self.made)
            self._open.update({name: _Sink(sink) for name, sink in self.sinks.items()})
        return self.where

    def _send(self, method: str, sent: dict, step: int, compact: Callable[[], dict] | None) -> None:
        """``backend.<method>(sent, step)`` on every open backend (opening them the first time),
        the dashboards getting ``compact()`` instead when it is given; a failing one is dropped."""
        self.open(step)
        assert self._open is not None  # opened just now
        grouped = None
        for name, backend in list(self._open.items()):
            action = getattr(backend, method, None)
            if action is None:
                self._cannot(name, backend, method)
                continue
            given = sent
            if compact is not None and name in GROUPED:
                grouped = given = grouped if grouped is not None else compact()
            if self._guard(name, action, given, step) is _FAILED:
                del self._open[name]
                try:
                    backend.close()
                except Exception:  # already reported: it is failing
                    pass

    def _cannot(self, name: str, backend: Backend, method: str) -> None:
        """Say once per backend that it shows no histograms (``method``: what it lacks), and why."""
        if not self._told.first(name):
            return
        why = getattr(backend, "NO_HISTOGRAMS", f"it has no {method} method")
        warn(f"monitored_optim: the {name} backend shows no histograms ({why}): update_hist/, grad_hist/ "
             f"and param_hist/ are left out there (TensorBoard, W&B, trackio, Comet and the jsonl "
             f"backend's histograms.jsonl have them)", UserWarning)

    def close(self) -> None:
        """Close every open backend (idempotent); a later ``log`` opens them again."""
        backends, self._open = self._open or {}, None
        for name, backend in backends.items():
            self._guard(name, backend.close)
        if self._release is not None:
            self._release()
            self._release = None

    def _guard(self, name: str, action: Callable[..., Any], *args: Any, what: str = "") -> Any:
        """``action(*args)``, or :data:`_FAILED` after warning (``strict``: the exception propagates);
        ``what``: the part of the backend that failed and is disabled (default: all of it)."""
        try:
            return action(*args)
        except Exception as err:
            if self.strict:
                raise
            who = f"your {name}" if name in self.sinks else f"the {name} backend"
            part = f"{who}'s {what}" if what else who
            warn(f"monitored_optim: {part} failed and {'are' if what else 'is'} disabled for the rest of this run "
                 f"({type(err).__name__}: {err}); training continues", RuntimeWarning)
            return _FAILED


class _Sink:
    """A user sink behind the :class:`Backend` protocol: ``log`` calls the object's ``log`` (or the
    callable itself) with a copy of the figures; ``close`` calls its ``close`` if it has one."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink

    def log(self, metrics: dict[str, float], step: int) -> None:
        log = getattr(self._sink, "log", None)
        (log if callable(log) else self._sink)(dict(metrics), step)

    def histograms(self, hists: dict[str, Histogram], step: int) -> None:
        """The object's ``histograms(hists, step)`` with a copy of the histograms, if it has one; else nothing."""
        histograms = getattr(self._sink, "histograms", None)
        if callable(histograms):
            histograms({tag: h.copy() for tag, h in hists.items()}, step)

    def alert(self, title: str, text: str, level: int) -> None:
        """The object's ``alert(title, text, level)``, if it has one; else nothing."""
        alert = getattr(self._sink, "alert", None)
        if callable(alert):
            alert(title, text, level)

    def close(self) -> None:
        close = getattr(self._sink, "close", None)
        if callable(close):
            close()


def _sink_name(sink: Any, i: int) -> str:
    """How warnings name a user sink: ``sink 0 (EarlyStop)``, ``sink 1 (alert)``."""
    label = getattr(sink, "__name__", None) or type(sink).__name__
    return f"sink {i} ({label})"


_FAILED = object()
"""What :meth:`Fanout._guard` returns for a failed action."""

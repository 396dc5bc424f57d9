"""JSON-lines backend: ``{logdir}/metrics.jsonl``, one object per logging step, and
``{logdir}/histograms.jsonl``, one object per logging step with histograms."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO

from ..histograms import EDGES, Histogram
from .bins import check, trimmed
from .rundir import METRICS


class Lines:
    """A file of JSON lines, appended to one object at a time.

    Each line goes to the file in one unbuffered ``write`` on a file opened for appending, so it is
    on disk when :meth:`write` returns and lines of several writers sharing the file never interleave.
    A row always starts a line: after a file that ends mid-line (a run killed while writing a row,
    or a write a full disk cut short), a newline goes before it, leaving the cut row on a line of
    its own, which the report skips.

    Raises:
        OSError: the file cannot be opened or written.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a+b", buffering=0)
        self._mid_line = _ends_mid_line(self._file)

    def write(self, row: dict) -> None:
        """Append ``row`` (JSON-serializable) as one line."""
        data = (("\n" if self._mid_line else "") + json.dumps(row) + "\n").encode()
        self._mid_line = self._file.write(data) < len(data)

    def close(self) -> None:
        self._file.close()


class JsonlBackend:
    """Appends ``{"step": N, "<tag>": <float>, ...}`` and a newline per logging step to
    ``metrics.jsonl`` (a :class:`Lines` file), and the step's histograms to ``histograms.jsonl``.

    Example line: ``{"step": 10, "update_to_data/fc1.weight": -2.97, "global/grad_norm": 0.41}``.

    ``histograms.jsonl`` is created at the first :meth:`histograms` (a run without the
    ``histograms`` family has none). Each line holds one logging step: the step, the bins' 114
    edges (:data:`~monitored_optim.histograms.EDGES`) and, per tag, the counts from the first to the
    last non-empty bin (``start`` is the index of the first) and the exact ``min``, ``max``, ``sum``
    and ``sum_squares`` of the elements counted (an empty histogram is
    ``{"start": 0, "counts": [], "sum": 0.0, "sum_squares": 0.0}``: no min, no max). Example line,
    edges cut short::

        {"step": 10, "edges": [-65536.0, ..., 65536.0], "update_hist/fc1.weight": {"start": 40,
         "counts": [3, 0, 57], "min": -0.0011, "max": 0.0009, "sum": -0.0021, "sum_squares": 4.1e-05}}
    """

    def __init__(self, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        self.path = logdir / METRICS
        self._lines = Lines(self.path)
        self._histograms: Lines | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._lines.write({"step": step, **metrics})

    def histograms(self, hists: dict[str, Histogram], step: int) -> None:
        """Append one line of ``hists`` (tag -> :class:`~monitored_optim.histograms.Histogram`) at ``step``."""
        row: dict = {"step": step, "edges": list(EDGES)}
        for tag, hist in hists.items():
            check(hist)
            start, kept = trimmed(hist)
            extremes = {"min": hist.min, "max": hist.max} if hist.min is not None else {}
            row[tag] = {"start": start, "counts": kept, **extremes, "sum": hist.sum, "sum_squares": hist.sum_squares}
        if self._histograms is None:
            self._histograms = Lines(self.path.with_name("histograms.jsonl"))
        self._histograms.write(row)

    def close(self) -> None:
        self._lines.close()
        if self._histograms is not None:
            self._histograms.close()


def _ends_mid_line(file: BinaryIO) -> bool:
    """Whether ``file`` (open for reading and appending) is not empty and does not end with a newline."""
    if not file.seekable() or file.seek(0, os.SEEK_END) == 0:
        return False
    file.seek(-1, os.SEEK_END)
    return file.read(1) != b"\n"

"""The figures of past logging steps, kept in memory for notebooks within a fixed number of values.

Each logging step is a row of float32 values in columns, one column per tag in the order tags first
appeared (NaN where a row lacks a tag). Rows are kept at every ``stride``-th logging step, from the
first; when the values kept exceed :data:`CAPACITY`, every other row is dropped and the stride
doubles, so the rows stay evenly spaced over the whole run and their number between half the
capacity's worth and all of it. The last logging step is always there as well.

Cost: 2,000 tensors log about 10,000 tags a step; a row is then 40 KB, and 16 MiB holds 419 rows:
over 10,000 logging steps, the rows of every 32nd (313 rows, 12.5 MB), and at each logging step
that keeps a row, one ``numpy.fromiter`` over its values.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # optional dependencies, imported when used
    import pandas

    from .report.read import Run

CAPACITY = 1 << 22
"""The most values the history keeps (float32: 16 MiB)."""


class History:
    """Rows of figures at evenly spaced logging steps over the whole run (module docstring).

    Args:
        capacity: the most values kept (an int >= 1); at least the latest row is always kept.
    """

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._columns: dict[str, int] = {}
        self._tags: tuple[str, ...] = ()  # the tags of the last row kept, in its order
        self._index: np.ndarray | None = None  # their columns; None where they are 0, 1, ... in order
        self._steps: list[int] = []
        self._rows: list[np.ndarray] = []
        self._stride = 1
        self._offered = 0
        self._last: tuple[int, dict[str, float]] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the kept rows take."""
        return sum(row.nbytes for row in self._rows)

    def record(self, step: int, figures: dict[str, float]) -> None:
        """Offer the figures of the logging step ``step`` (tag -> value); kept if the stride says so."""
        self._last = (step, figures)
        self._offered += 1
        if (self._offered - 1) % self._stride:
            return
        tags = tuple(figures)
        if tags != self._tags:
            for tag in tags:
                self._columns.setdefault(tag, len(self._columns))
            index = np.fromiter((self._columns[tag] for tag in tags), np.int64, len(tags))
            self._tags, self._index = tags, None if np.array_equal(index, np.arange(len(tags))) else index
        values = np.fromiter(figures.values(), np.float32, len(tags))
        if self._index is not None:
            row = np.full(len(self._columns), np.nan, np.float32)
            row[self._index] = values
            values = row
        self._steps.append(step)
        self._rows.append(values)
        while len(self._rows) > 1 and sum(len(row) for row in self._rows) > self.capacity:
            self._steps, self._rows = self._steps[::2], self._rows[::2]
            self._stride *= 2

    def frame(self) -> pandas.DataFrame:
        """The kept rows and the last logging step as a DataFrame: index ``step``, a float32 column
        per tag in first-appearance order, NaN where a step did not log the tag.

        Raises:
            ImportError: pandas is not installed (the message names the extra that brings it).
        """
        try:
            import pandas
        except ImportError:
            raise ImportError("opt.monitor.history() returns a pandas DataFrame and pandas is not installed: "
                              "pip install 'monitored_optim[notebook]' (or pip install pandas)") from None
        steps, tags, table = self._table()
        return pandas.DataFrame(table, index=pandas.Index(steps, name="step"), columns=tags)

    def run(self, path: Path, kinds: dict[str, str]) -> Run:
        """The history as the report's :class:`~monitored_optim.report.read.Run` (source ``"memory"``),
        its parameters' ``kinds`` (label -> ``matrix`` or ``vector``) given."""
        from .report.errors import ReportError
        from .report.read import assemble

        steps, tags, table = self._table()
        if not steps:
            raise ReportError("monitored_optim: nothing logged yet: the history fills at each logging step")
        records = [(step, {tag: float(v) for tag, v in zip(tags, row.tolist()) if not math.isnan(v)})
                   for step, row in zip(steps, table)]
        run = assemble(path, "memory", records)
        run.kinds = kinds
        return run

    def _table(self) -> tuple[list[int], list[str], np.ndarray]:
        """The steps, the tags and a ``(steps, tags)`` float32 table of the kept rows and the last step."""
        steps, rows, columns = list(self._steps), list(self._rows), dict(self._columns)
        if self._last is not None and (not steps or steps[-1] != self._last[0]):
            for tag in self._last[1]:
                columns.setdefault(tag, len(columns))
            last = np.full(len(columns), np.nan, np.float32)
            for tag, value in self._last[1].items():
                last[columns[tag]] = value
            steps.append(self._last[0])
            rows.append(last)
        table = np.full((len(rows), len(columns)), np.nan, np.float32)
        for i, row in enumerate(rows):
            table[i, :len(row)] = row
        return steps, list(columns), table

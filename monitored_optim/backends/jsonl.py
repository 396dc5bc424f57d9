"""JSON-lines backend: ``{logdir}/metrics.jsonl``, one object per logging step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO


class JsonlBackend:
    """Appends ``{"step": N, "<tag>": <float>, ...}`` and a newline per logging step.

    Each line goes to the file in one unbuffered ``write`` on a file opened for appending, so it is
    on disk when ``log`` returns and lines of several writers sharing the file never interleave.
    A row always starts a line: after a file that ends mid-line (a run killed while writing a row,
    or a write a full disk cut short), a newline goes before it, leaving the cut row on a line of
    its own, which the report skips.

    Example line: ``{"step": 10, "update_to_data/fc1.weight": -2.97, "global/grad_norm": 0.41}``.
    """

    def __init__(self, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        self.path = logdir / "metrics.jsonl"
        self._file = open(self.path, "a+b", buffering=0)
        self._mid_line = _ends_mid_line(self._file)

    def log(self, metrics: dict[str, float], step: int) -> None:
        line = ("\n" if self._mid_line else "") + json.dumps({"step": step, **metrics}) + "\n"
        data = line.encode()
        self._mid_line = self._file.write(data) < len(data)

    def close(self) -> None:
        self._file.close()


def _ends_mid_line(file: BinaryIO) -> bool:
    """Whether ``file`` (open for reading and appending) is not empty and does not end with a newline."""
    if not file.seekable() or file.seek(0, os.SEEK_END) == 0:
        return False
    file.seek(-1, os.SEEK_END)
    return file.read(1) != b"\n"

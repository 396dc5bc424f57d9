"""JSON-lines backend: ``{logdir}/metrics.jsonl``, one object per logging step."""

from __future__ import annotations

import json
from pathlib import Path


class JsonlBackend:
    """Appends ``{"step": N, "<tag>": <float>, ...}`` and a newline per logging step.

    Each line goes to the file in one unbuffered ``write`` on a file opened for appending, so it is
    on disk when ``log`` returns and lines of several writers sharing the file never interleave.

    Example line: ``{"step": 10, "update_to_data/fc1.weight": -2.97, "global/grad_norm": 0.41}``.
    """

    def __init__(self, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        self.path = logdir / "metrics.jsonl"
        self._file = open(self.path, "ab", buffering=0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._file.write((json.dumps({"step": step, **metrics}) + "\n").encode())

    def close(self) -> None:
        self._file.close()

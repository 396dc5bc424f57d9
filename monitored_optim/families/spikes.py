"""Per-layer spikes: a parameter's grad norm or update-to-data ratio far from its own recent past.

For each monitored parameter and each of ``log10(grad_norm)`` and ``update_to_data`` (both log10,
so a spike is a factor), the baseline is the median m and the median absolute deviation MAD of its
last :data:`WINDOW` logged values. A value x spikes when it has at least :data:`MIN_HISTORY` values
behind it and

    |x - m| > max(THRESHOLD · 1.4826 · MAD, FLOOR)

(1.4826 · MAD estimates a standard deviation for normal data; FLOOR, a factor of 10, keeps a
parameter whose figure barely moves, or falls steadily early in training, from spiking on noise). A spiking value does not enter
the baseline. Computed from the figures already on the host: no device work, no sync.
Source: Hampel's identifier (Hampel 1974; Pearson 2002, "Outliers in process modeling and
identification").
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from .._warnings import warn
from .base import Family

WINDOW = 20
MIN_HISTORY = 5
THRESHOLD = 6.0
FLOOR = 1.0
FIGURES = ("grad_norm", "update_to_data")


class Spikes(Family):
    """``health/spikes``: the number of parameters whose grad norm or update-to-data ratio spiked at
    this logging step; a warning names the first parameters to spike and the step."""

    def __init__(self) -> None:
        self._history: dict[tuple[str, str], deque[float]] = {}
        self._told = False

    def figures(self, step: Any) -> dict[str, float]:
        spiking = []
        for name in step.names:
            hits = [kind for kind in FIGURES if self._spikes(name, kind, step.figures.get(f"{kind}/{name}"))]
            if hits:
                spiking.append((name, hits))
        if spiking and not self._told:
            self._told = True
            shown = ", ".join(f"{name!r} ({' and '.join(hits)})" for name, hits in spiking[:5])
            more = f" and {len(spiking) - 5} more" if len(spiking) > 5 else ""
            warn(f"monitored_optim: spike at step {step.step} in {shown}{more}: far outside each one's "
                 f"last {WINDOW} logged values (health/spikes counts them at every logging step)", RuntimeWarning)
        return {"health/spikes": float(len(spiking))}

    def _spikes(self, name: str, kind: str, value: float | None) -> bool:
        if value is None or (kind == "grad_norm" and value <= 0):
            return False
        x = math.log10(value) if kind == "grad_norm" else value
        past = self._history.setdefault((name, kind), deque(maxlen=WINDOW))
        spike = False
        if len(past) >= MIN_HISTORY:
            median = statistics.median(past)
            mad = statistics.median(abs(v - median) for v in past)
            spike = abs(x - median) > max(THRESHOLD * 1.4826 * mad, FLOOR)
        if not spike:
            past.append(x)
        return spike

"""The fixed bins of the ``histograms`` family: signed powers of two, the same for every tensor.

Every histogram the monitor makes (``update_hist/{name}``, ``grad_hist/{name}``,
``param_hist/{name}``) counts the finite elements of a tensor in the same :data:`NBINS` bins, with
the :data:`EDGES` e_0 < e_1 < ... < e_{m-1} (m = ``NBINS - 1``):

    bin 0       x < e_0 = -2**HIGH            (open-ended)
    bin i       e_{i-1} <= x < e_i            (numpy's half-open bins)
    bin m       x >= e_{m-1} = 2**HIGH        (open-ended)

The edges are ``-2**HIGH, ..., -2**LOW, 2**LOW, ..., 2**HIGH``, one bin per power of two (about
3.3 per decade) on each side, so the bin between ``-2**LOW`` and ``2**LOW`` (:data:`ZERO`, about
±9.1e-13) holds the exact zeros: an update lost to bf16 rounding, a frozen weight, a zero gradient.
Every edge is a power of two, exact in float32, float64, bfloat16's and float16's float32 upcast,
so a count does not depend on the dtype the comparison runs in, and counts equal
``numpy.histogram(x, [-inf, *EDGES, inf])`` over the finite elements of x. Non-finite elements are
not binned (``health/`` counts them). Counts of the same bins add: over the parts and shards of a
parameter, over ranks, over steps.

Beside its counts a histogram holds the exact min, max, sum and sum of squares of the same finite
elements (:class:`Histogram`): the bins say how the elements spread, these where they end and their
total. A tensor's histogram is three pieces, each with its declared reduction (:data:`PIECES`): the
counts followed by the sums (SUM), the min (MIN) and the max (MAX).

Here are the bins, :class:`Histogram`, :func:`added` and :func:`of`, the histograms of a logging
step's host pieces. The rule that gives an element its bin from its bits, and the counts of one
tensor, are :mod:`monitored_optim.capture.bits`; the capture's binning of a step's parts and chunks
is :mod:`monitored_optim.capture.binning`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .pieces import MAX, MIN, SUM

__all__ = ["LOW", "HIGH", "EDGES", "NBINS", "ZERO", "KEYS", "piece_keys", "PIECES", "WIDTH", "WIDTHS", "Histogram",
           "added", "of"]  # the API page's names, in the order of the source

LOW, HIGH = -40, 16
"""The smallest and largest magnitude edges: 2**-40 (about 9.1e-13) and 2**16 (65,536)."""

EDGES: tuple[float, ...] = tuple([-(2.0 ** k) for k in range(HIGH, LOW - 1, -1)]
                                 + [2.0 ** k for k in range(LOW, HIGH + 1)])
"""The bin edges, increasing: 114 signed powers of two."""

NBINS = len(EDGES) + 1
"""Bins per histogram: 115 (the two outer ones open-ended)."""

ZERO = EDGES.index(-(2.0 ** LOW)) + 1
"""The bin of zero: ``-2**LOW <= x < 2**LOW``."""

KEYS = {"u": "update_hist", "grad": "grad_hist", "param": "param_hist"}
"""What is binned -> its piece key and tag series: the stored change u, the grad the step used,
the parameter after the step."""


def piece_keys(series: str) -> tuple[str, str, str]:
    """The piece keys of a histogram of ``series`` (``update_hist``, ...): its counts and sums, its min, its max."""
    return series, f"hist_min:{series}", f"hist_max:{series}"


PIECES = {key: how for series in KEYS.values() for key, how in zip(piece_keys(series), (SUM, MIN, MAX))}
"""Every piece key of the histograms -> its reduction: per series the counts of its finite elements
in the bins followed by their ``(Σx, Σx²)`` (SUM, :data:`WIDTH` values), their min (MIN) and their max (MAX)."""

WIDTH = NBINS + 2
"""Values of a histogram's SUM piece: the :data:`NBINS` counts, then Σx and Σx²."""

WIDTHS = {series: WIDTH for series in KEYS.values()}
"""The width of each piece of :data:`PIECES` that holds more than one value."""


class Histogram(list):
    """One tensor's histogram: the counts of its finite elements in the :data:`NBINS` fixed bins (a
    list of ints), with the exact extremes and sums of the same elements.

    Attributes:
        min: the smallest finite element (float); None where there is none (an empty tensor, or one
            of NaN and infinities only).
        max: the largest finite element (float), or None likewise.
        sum: Σx over the finite elements (0.0 where there is none).
        sum_squares: Σx² over the finite elements (0.0 where there is none).

    Example: ``Histogram(counts, -0.0012, 0.0011, -0.08, 2.1e-5)``; ``list(h)`` is the counts.
    """

    def __init__(self, counts: Iterable[int] = (), min: float | None = None, max: float | None = None,
                 sum: float = 0.0, sum_squares: float = 0.0) -> None:
        super().__init__(counts)
        self.min, self.max, self.sum, self.sum_squares = min, max, sum, sum_squares

    def copy(self) -> Histogram:
        """A new histogram with the same counts, extremes and sums."""
        return Histogram(self, self.min, self.max, self.sum, self.sum_squares)

    def __reduce__(self) -> tuple:
        """Pickled with its extremes and sums (under ``torch.distributed`` results cross processes)."""
        return Histogram, (list(self), self.min, self.max, self.sum, self.sum_squares)

    def __repr__(self) -> str:
        """The counts, then the extremes and sums by name."""
        return (f"Histogram({list.__repr__(self)}, min={self.min!r}, max={self.max!r}, sum={self.sum!r}, "
                f"sum_squares={self.sum_squares!r})")


def added(hists: list[Histogram]) -> Histogram:
    """The histogram of the elements of all ``hists`` together: counts added bin by bin, the least
    min, the greatest max, the sums added."""
    lows = [h.min for h in hists if h.min is not None]
    highs = [h.max for h in hists if h.max is not None]
    return Histogram([sum(column) for column in zip(*hists, strict=True)], min(lows) if lows else None,
                     max(highs) if highs else None, sum(h.sum for h in hists), sum(h.sum_squares for h in hists))


def of(names: list[str], pieces: list[dict[str, list[float]]]) -> dict[str, Histogram]:
    """The logging step's histograms, tag (``update_hist/{name}``, ...) -> :class:`Histogram`, from
    each parameter's host pieces (``names[i]``'s in ``pieces[i]``; empty where the ``histograms``
    family is off). Counts reduced over ranks are weighted sums: rounded here; a min or max that is
    not finite (no finite element) is None."""
    out = {}
    for name, got in zip(names, pieces):
        for series in KEYS.values():
            summed = got.get(series)
            if summed is not None:
                _, low, high = (got.get(key) for key in piece_keys(series))
                out[f"{series}/{name}"] = Histogram(map(round, summed[:NBINS]), _finite(low), _finite(high),
                                                    summed[NBINS], summed[NBINS + 1])
    return out


def _finite(value: list[float] | None) -> float | None:
    """The one host value of a min or max piece, None where it is missing or not finite."""
    return value[0] if value is not None and abs(value[0]) != math.inf else None

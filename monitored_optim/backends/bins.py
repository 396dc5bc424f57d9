"""What the backends that show histograms share: the non-empty span of a histogram and its finite edges.

A histogram arrives as the dense counts of :data:`~monitored_optim.histograms.NBINS` fixed bins
(:mod:`monitored_optim.histograms`); the two outer bins are open-ended. A dashboard draws bins
between finite edges, so each backend sends the span from the first to the last non-empty bin,
with :func:`edges` giving an open outer bin a display edge one power of two beyond its finite one
(``x < -2**16`` is drawn as ``[-2**17, -2**16)``).
"""

from __future__ import annotations

from ..histograms import EDGES, HIGH, NBINS

OUTER = 2.0 ** (HIGH + 1)
"""The display edge of the open outer bins: ``-OUTER`` left of bin 0, ``OUTER`` right of the last bin."""

LIMITS: tuple[float, ...] = (-OUTER, *EDGES, OUTER)
"""The finite edges of every bin: bin ``i`` is drawn as ``[LIMITS[i], LIMITS[i + 1])`` (``NBINS + 1`` values)."""

MIDDLES: tuple[float, ...] = tuple((a + b) / 2 for a, b in zip(LIMITS, LIMITS[1:]))
"""A value standing for each bin: the middle of its drawn interval (0 for the zero bin,
``1.5 * 2**k`` for ``[2**k, 2**(k+1))``); sums and tracker positions made from it are approximate."""


def span(counts: list[int]) -> tuple[int, int]:
    """``(start, stop)``: the first non-empty bin and one past the last, ``(0, 0)`` when all are empty.

    Example: ``span([0, 3, 0, 5, 0])`` is ``(1, 4)``.
    """
    nonzero = [i for i, c in enumerate(counts) if c]
    return (nonzero[0], nonzero[-1] + 1) if nonzero else (0, 0)


def trimmed(counts: list[int]) -> tuple[int, list[int]]:
    """``(start, counts[start:stop])`` over :func:`span`: the histogram without its empty ends."""
    start, stop = span(counts)
    return start, [int(c) for c in counts[start:stop]]


def edges(start: int, stop: int) -> list[float]:
    """The ``stop - start + 1`` finite edges of bins ``start`` to ``stop - 1`` (:data:`LIMITS`)."""
    return list(LIMITS[start:stop + 1])


def as_bins(hists: dict[str, list[int]]) -> dict[str, tuple[list[int], list[float]]]:
    """Each non-empty histogram as ``(counts, edges)`` over its span, finite edges (:func:`edges`):
    the ``np_histogram`` that ``wandb.Histogram`` and ``trackio.Histogram`` take."""
    out = {}
    for tag, counts in hists.items():
        check(counts)
        start, stop = span(counts)
        if stop > start:
            out[tag] = ([int(c) for c in counts[start:stop]], edges(start, stop))
    return out


def check(counts: list[int]) -> None:
    """Raise ``ValueError`` unless ``counts`` has :data:`NBINS` entries (a backend's guard names it)."""
    if len(counts) != NBINS:
        raise ValueError(f"a histogram has {NBINS} counts, got {len(counts)}")

"""What the backends that show histograms share: the non-empty span of a histogram and its drawn edges.

A histogram arrives as a :class:`~monitored_optim.histograms.Histogram`: the dense counts of
:data:`~monitored_optim.histograms.NBINS` fixed bins (:mod:`monitored_optim.histograms`; the two
outer bins open-ended) with the exact min and max of its elements. A dashboard draws bins between
finite edges, so each backend sends the span from the first to the last non-empty bin, drawn from
the exact min to the exact max (:func:`edges`), as TensorBoard draws a ``HistogramProto``.
"""

from __future__ import annotations

from ..histograms import EDGES, HIGH, NBINS, Histogram

OUTER = 2.0 ** (HIGH + 1)
"""The display edge of the open outer bins where a value must stand for them (Comet's middles):
``-OUTER`` left of bin 0, ``OUTER`` right of the last bin."""

LIMITS: tuple[float, ...] = (-OUTER, *EDGES, OUTER)
"""The finite edges of every bin: bin ``i`` is drawn as ``[LIMITS[i], LIMITS[i + 1])`` (``NBINS + 1`` values)."""

MIDDLES: tuple[float, ...] = tuple((a + b) / 2 for a, b in zip(LIMITS, LIMITS[1:]))
"""A value standing for each bin: the middle of its interval (0 for the zero bin, ``1.5 * 2**k`` for
``[2**k, 2**(k+1))``); tracker positions made from it are approximate."""


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


def edges(hist: Histogram) -> list[float]:
    """The drawn edges of the non-empty bins of ``hist`` (its :func:`span`, not empty): its exact min,
    the fixed edges between those bins (:data:`LIMITS`), its exact max; ``[min, max]`` for one bin.

    Example: a histogram of 0.3 and 0.7 is drawn as ``[0.3, 0.5, 0.7]`` (bins ``[0.25, 0.5)`` and ``[0.5, 1)``).
    """
    start, stop = span(hist)
    assert hist.min is not None and hist.max is not None  # a histogram with a count has both
    return [hist.min, *LIMITS[start + 1:stop], hist.max]


def as_bins(hists: dict[str, Histogram]) -> dict[str, tuple[list[int], list[float]]]:
    """Each non-empty histogram as ``(counts, edges)`` over its span, drawn from its min to its max
    (:func:`edges`): the ``np_histogram`` that ``wandb.Histogram`` and ``trackio.Histogram`` take."""
    out = {}
    for tag, hist in hists.items():
        check(hist)
        start, stop = span(hist)
        if stop > start:
            out[tag] = ([int(c) for c in hist[start:stop]], edges(hist))
    return out


def check(hist: Histogram) -> None:
    """Raise ``TypeError`` unless ``hist`` is a :class:`~monitored_optim.histograms.Histogram`, and
    ``ValueError`` unless it has :data:`NBINS` counts and, where it counts elements, a min and a max
    (a backend's guard names it)."""
    if not isinstance(hist, Histogram):
        raise TypeError(f"a histogram is a monitored_optim.histograms.Histogram, got {type(hist).__name__}")
    if len(hist) != NBINS:
        raise ValueError(f"a histogram has {NBINS} counts, got {len(hist)}")
    if any(hist) and (hist.min is None or hist.max is None):
        raise ValueError("a histogram that counts elements has their min and max")

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

Here are the bins, :class:`Histogram`, the rule that gives an element its bin from its bits
(:func:`keys`, :func:`fold`), :func:`counts` of one tensor and :func:`of`, the histograms of a
logging step's host pieces; the capture's binning of a step's parts and chunks is
:mod:`monitored_optim.capture.binning`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from .pieces import MAX, MIN, SUM
from .workspace import Workspace

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


BITS = {torch.float32: (torch.int32, 23, 8), torch.bfloat16: (torch.int16, 7, 8), torch.float64: (torch.int64, 52, 11)}
"""Dtype -> (the integer dtype of its bits, mantissa bits, exponent bits): the dtypes binned from
their bits (float16 is binned as float32, where its subnormals are normal)."""

_FOLDS: dict[tuple[torch.dtype, torch.device, bool], Tensor] = {}


def counts(x: Tensor, scale: Tensor | None = None, work: Workspace | None = None) -> Tensor:
    """The histogram of ``x``'s finite elements over :data:`EDGES`, on ``x``'s device.

    Each element's bin comes from its bits (:func:`keys`, or :func:`finite_keys` for a CPU tensor whose
    elements are all finite): its sign and the exponent of ``|x|``, of ``|x|`` less one unit in the
    last place for a negative one (so that ``-2**k`` is the lower end of its bin, as numpy's half-open
    bins have it). The keys are counted and folded into the bins (:func:`fold`).

    Args:
        x: a floating tensor of any shape, dtype and layout (float16 is binned after an exact upcast
            to float32; a complex one as its real and imaginary parts; a sparse one with its zeros).
        scale: an optional 0-dim tensor by which ``x`` is multiplied first (the reciprocal of a
            fused GradScaler's scale: exact for a power of two).
        work: where the temporaries go (:func:`keys`); None: new tensors.

    Returns:
        Float64 tensor of shape ``(NBINS,)``: the counts (whole numbers; float64 so that they add
        with the other pieces, exactly up to 2**53 elements).
    """
    flat = flattened(x, scale)
    table, counts = keys_counted(flat, finite_ends(flat) is not None, work)
    return folded(counts.view(1, -1), table)[0]


def flattened(x: Tensor, scale: Tensor | None) -> Tensor:
    """``x`` as the 1-D tensor that is binned: dense, complex as real pairs, float16 (and other dtypes
    not of :data:`BITS`) as float32, times ``scale``."""
    x = x.detach()
    if x.is_sparse:  # nn.Embedding(sparse=True)'s grad: its zeros count too
        x = x.to_dense()
    flat = (torch.view_as_real(x) if x.is_complex() else x).reshape(-1)
    if flat.dtype not in BITS:
        flat = flat.float()
    if scale is not None:
        flat = flat * scale.to(flat.dtype)
    return flat


def finite_ends(flat: Tensor) -> tuple[float, float] | None:
    """``(min, max)`` of a non-empty CPU tensor whose elements are all finite; None on another device
    (where reading a value waits for the device), for an empty tensor, or where an element is NaN or
    infinite (NaN reaches both ends)."""
    if not flat.numel() or flat.device.type != "cpu":
        return None
    low, high = (end.item() for end in torch.aminmax(flat))
    return (low, high) if math.isfinite(low) and math.isfinite(high) else None


def keys_counted(flat: Tensor, finite: bool, work: Workspace | None) -> tuple[Tensor, Tensor]:
    """The fold table of a 1-D tensor of a dtype of :data:`BITS` and the counts of its keys (int64,
    one per key of the table); ``finite``: each of its elements is (:func:`finite_keys`)."""
    table = fold(flat.dtype, flat.device, finite)
    return table, occurrences(finite_keys(flat, work) if finite else keys(flat, work), len(table))


def occurrences(key: Tensor, size: int) -> Tensor:
    """How many of ``key`` (uint8, int32 or int64, values in ``[0, size)``) hold each value: int64 ``(size,)``.

    ``bincount`` on a CPU, where its read of the largest key to size its result costs nothing (and it
    counts faster); elsewhere ``index_add_`` of ones, which does not wait for the device."""
    if key.device.type == "cpu":
        return torch.bincount(key, minlength=size)
    key = key.int() if key.dtype is torch.uint8 else key  # index_add_ takes int32 and int64 indices
    counts = torch.zeros(size, dtype=torch.int64, device=key.device)
    return counts.index_add_(0, key, torch.ones(1, dtype=torch.int64, device=key.device).expand(key.numel()))


def folded(counts: Tensor, table: Tensor) -> Tensor:
    """Float64 ``(k, NBINS)`` counts of the bins from k rows of counts of keys, int64 ``(k, len(table))``."""
    out = torch.zeros(counts.shape[0], NBINS + 1, dtype=torch.float64, device=counts.device)
    return out.index_add_(1, table, counts.double())[:, :NBINS]


def keys(flat: Tensor, work: Workspace | None = None) -> Tensor:
    """Each element's key, from its bits: ``E`` (the biased exponent) for a positive element,
    ``E' + top + 2`` for a negative one (``E'`` that of ``|x|`` less one unit in the last place, -1
    for -0.0; ``top`` the all-ones exponent), and -inf moved to the key of +inf.

    Args:
        flat: 1-D tensor of a dtype of :data:`BITS`.
        work: a :class:`~monitored_optim.workspace.Workspace` whose named buffers hold the
            temporaries (valid until its next request of the same name); None: new tensors.

    Returns:
        int32 (int64 for float64) tensor like ``flat``, values in ``[0, 2·top + 2]``.
    """
    kind, mantissa, exponent = BITS[flat.dtype]
    top, sign = (1 << exponent) - 1, torch.iinfo(kind).min
    bits = flat.contiguous().view(kind)
    neg = torch.bitwise_right_shift(bits, 8 * bits.element_size() - 1, out=_room(work, "neg", bits))  # -1 if < 0
    key = torch.bitwise_and(bits, ~sign, out=_room(work, "key", bits))  # |x|'s bits
    key += neg
    key >>= mantissa
    key.sub_(neg, alpha=top + 2)
    minus_inf = torch.eq(bits, sign | (top << mantissa), out=_room(work, "inf", bits, torch.bool))
    key.masked_fill_(minus_inf, top)  # as +inf
    return key if kind is not torch.int16 else key.int()  # counted as int32 (_count)


def finite_keys(flat: Tensor, work: Workspace | None = None) -> Tensor:
    """Each element's key, from its bits, for a tensor whose elements are all finite: ``E`` (the biased
    exponent) for a positive element, ``E' + top + 1`` for a negative one (``E'`` that of ``|x|`` less
    one unit in the last place; ``top`` the all-ones exponent); -0.0, whose bits less one wrap round to
    the largest integer, gets ``top``, the key of no finite element. Four integer passes where
    :func:`keys` takes seven; the keys differ, and so does their :func:`fold`.

    Args:
        flat: 1-D tensor of a dtype of :data:`BITS`, without NaN or infinities.
        work: as :func:`keys`'.

    Returns:
        int32 (int64 for float64) tensor like ``flat``, values in ``[0, 2·top + 1]``.
    """
    kind = BITS[flat.dtype][0]
    sign, mantissa, mask = _shifts(flat.dtype, flat.device)
    bits = flat.contiguous().view(kind)
    key = torch.bitwise_right_shift(bits, sign, out=_room(work, "key", bits))  # -1 if < 0
    key += bits
    key >>= mantissa  # a negative's key is now E' - top - 1 (arithmetic shift)
    key &= mask
    return key if kind is not torch.int16 else key.int()  # counted as int32 (_count)


_SHIFTS: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}


def _shifts(dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`finite_keys`' operands for ``dtype`` as 0-dim tensors of its integer dtype on ``device``
    (a Python int is made into a tensor at each op): the shift of the sign bit to the lowest, the
    mantissa bits and the mask of a key."""
    if (dtype, device) not in _SHIFTS:
        kind, mantissa, exponent = BITS[dtype]
        sign, bits, mask = (torch.tensor(v, dtype=kind, device=device)
                            for v in (8 * kind.itemsize - 1, mantissa, (2 << exponent) - 1))
        _SHIFTS[dtype, device] = sign, bits, mask
    return _SHIFTS[dtype, device]


def _room(work: Workspace | None, name: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A temporary shaped like ``like`` (of its dtype, or ``dtype``): ``work``'s buffer ``name``, valid
    until its next request of that name, or a new tensor where ``work`` is None."""
    kind = like.dtype if dtype is None else dtype
    return torch.empty_like(like, dtype=kind) if work is None else work.named(name, like, kind)


def fold(dtype: torch.dtype, device: torch.device, finite: bool = False) -> Tensor:
    """Key -> bin, int64 on ``device``: of :func:`keys`, or with ``finite`` of :func:`finite_keys`
    (:data:`NBINS` for a key not binned: inf, NaN), by the rule of
    :func:`~monitored_optim.capture.binning.element_bins` (:func:`steps`)."""
    table = _FOLDS.get((dtype, device, finite))
    if table is None:
        top = (1 << BITS[dtype][2]) - 1
        e = torch.arange(-1, top + 1)  # E' of a negative from -1 (-0.0), E of a positive from 0
        up, down = ZERO + steps(e[1:], top >> 1), ZERO - steps(e, top >> 1)
        up[top] = down[top + 1] = NBINS
        if finite:  # top: -0.0; a negative's E' from 0
            up[top], down = ZERO, down[1:]
        table = _FOLDS[dtype, device, finite] = torch.cat([up, down]).to(device)
    return table


def steps(e: Tensor, bias: int) -> Tensor:
    """How many bins from :data:`ZERO` the magnitudes ``[2**k, 2**(k+1))`` lie, k = e - bias (e a
    biased exponent, any integer tensor): 0 below ``2**LOW``, one per power of two up to ``2**HIGH``."""
    return (e - (bias + LOW - 1)).clamp(0, HIGH - LOW + 1)


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

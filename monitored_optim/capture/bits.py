"""The bit kernels that key and count float values into the fixed bins of :mod:`monitored_optim.histograms`.

An element's bin comes from its bits (:data:`BITS`): its sign and the exponent of ``|x|``, of ``|x|``
less one unit in the last place for a negative one, so that ``-2**k`` is the lower end of its bin
as numpy's half-open bins have it. :func:`keys` (or :func:`finite_keys`, for a tensor whose elements
are all finite) gives each element such a key, :func:`occurrences` counts the keys, and the key
counts are folded into the bins by a table (:func:`fold`, :func:`folded`). :func:`counts` is the
histogram of one tensor; the capture's binning of a logging step's parts and chunks, with the
extremes and sums beside the counts, is :mod:`monitored_optim.capture.binning`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..histograms import HIGH, LOW, NBINS, ZERO
from ..workspace import Workspace

BITS = {torch.float32: (torch.int32, 23, 8), torch.bfloat16: (torch.int16, 7, 8), torch.float64: (torch.int64, 52, 11)}
"""Dtype -> (the integer dtype of its bits, mantissa bits, exponent bits): the dtypes binned from
their bits (float16 is binned as float32, where its subnormals are normal)."""

_FOLDS: dict[tuple[torch.dtype, torch.device, bool], Tensor] = {}


def counts(x: Tensor, scale: Tensor | None = None, work: Workspace | None = None) -> Tensor:
    """The histogram of ``x``'s finite elements over :data:`~monitored_optim.histograms.EDGES`, on ``x``'s device.

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
    (:data:`~monitored_optim.histograms.NBINS` for a key not binned: inf, NaN), by the rule of
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
    """How many bins from :data:`~monitored_optim.histograms.ZERO` the magnitudes ``[2**k, 2**(k+1))``
    lie, k = e - bias (e a biased exponent, any integer tensor): 0 below ``2**LOW``, one per power of
    two up to ``2**HIGH``."""
    return (e - (bias + LOW - 1)).clamp(0, HIGH - LOW + 1)

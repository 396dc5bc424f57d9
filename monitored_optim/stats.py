"""Per-tensor moments on the device, finished in one batch, copied to the host once, and the figures.

Each tensor x is reduced on its device to raw sums (:func:`sums`: centred for tensors whose mean
dwarfs their spread, such as a LayerNorm weight near 1.0 with std 1e-4, uncentred otherwise),
:func:`finish` turns every row of a logging step into ``(mean, m2)`` in float64 at once, with
``m2 = sum((x - mean)^2)``, and :func:`to_host` copies them with one copy per device. The element
count n stays on the host. From a row: ``std = sqrt(m2 / (n - 1))`` (Bessel's correction, as
``torch.std(correction=1)``) and ``||x||_2 = sqrt(m2 + n * mean^2)`` (both terms >= 0: no
cancellation). Rows of disjoint pieces combine as power sums (Chan, Golub & LeVeque 1979), which
is what sharded training needs (``distributed.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def moments(x: Tensor, scratch: bool = False) -> Tensor:
    """The ``(mean, m2)`` of ``x`` as a float64 tensor of shape ``(2,)`` on ``x``'s device.

    ``finish([sums(x, centre=True, scratch=scratch)], [count(x)])``: see :func:`sums` and
    :func:`finish`.

    Args:
        x: any floating or complex tensor, any shape. Complex counts as pairs of reals, sparse is
            densified, bf16/fp16 is promoted to float32 first. Its element count is
            :func:`count` ``(x)``, which the caller keeps on the host.
        scratch: ``x`` is a temporary the caller drops: centre it in place instead of allocating.

    Returns:
        Tensor of shape ``(2,)``, dtype float64. No host synchronisation.
    """
    return finish([sums(x, centre=True, scratch=scratch)], [count(x)])[0]


def sums(x: Tensor, centre: bool, scratch: bool = False) -> Tensor:
    """Raw sums of ``x`` for :func:`finish`: ``(mean, sum(x - mean), ||x - mean||)`` when ``centre``
    (two passes, a temporary unless ``scratch``), else ``(sum(x), ||x||)`` (one pass, none).

    Centring keeps the spread of a tensor whose mean dwarfs it (a LayerNorm weight near 1.0 with
    std 1e-4), and the sum of the centred values removes the rounding of the float32 mean (the
    shifted-data formulas, Chan, Golub & LeVeque 1983). Without centring the float32 rounding costs
    about 1e-7 * mean^2 / var of the variance: use it where ``mean^2 / var <= CENTRE_ABOVE``.

    Returns:
        Tensor of shape ``(3,)`` or ``(2,)`` in ``x``'s real dtype (float32 for bf16/fp16), on its device.
    """
    dense = _dense_real(x)
    if not centre:
        return torch.stack([dense.sum(), torch.linalg.vector_norm(dense)])
    if dense.numel() == 0:
        return dense.new_zeros(3)
    mean = dense.mean()
    in_place = scratch and not x.is_sparse and dense.data_ptr() == x.data_ptr()
    centred = dense.sub_(mean) if in_place else dense - mean
    return torch.stack([mean, centred.sum(), torch.linalg.vector_norm(centred)])


def scale_sums(row: Tensor, factor: float | Tensor) -> Tensor:
    """:func:`sums` of ``factor * x`` from those of ``x``: every entry times ``factor``, the norm
    (last entry) times ``|factor|``."""
    f = torch.as_tensor(factor, dtype=row.dtype, device=row.device)
    return torch.cat([row[:-1] * f, row[-1:] * f.abs()])


def sums_many(xs: list[Tensor], centre: list[bool]) -> list[Tensor]:
    """:func:`sums` of every tensor; the uncentred norms come from one ``torch._foreach_norm`` per
    device and dtype instead of one kernel per tensor."""
    rows: list[Tensor | None] = [sums(x, centre=True) if c else None for x, c in zip(xs, centre)]
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, Tensor]]] = {}
    for i, x in enumerate(xs):
        if rows[i] is None:
            dense = _dense_real(x)
            groups.setdefault((dense.device, dense.dtype), []).append((i, dense))
    for members in groups.values():
        totals = torch.stack([dense.sum() for _, dense in members])
        norms = torch.stack(torch._foreach_norm([dense for _, dense in members]))
        for (i, _), row in zip(members, torch.stack([totals, norms], 1).unbind(0)):
            rows[i] = row
    return rows  # type: ignore[return-value]


def finish(raw: list[Tensor], counts: list[int]) -> list[Tensor]:
    """``(mean, m2)`` rows in float64 from :func:`sums` rows, all at once per device and kind.

    Centred ``(c, r, q)``: mean = c + r/n, m2 = q^2 - r^2/n. Uncentred ``(s, q)``: mean = s/n,
    m2 = q^2 - s^2/n. Empty tensors give ``(0, 0)``.

    Args:
        raw: rows of :func:`sums`. counts: element counts n (:func:`count`), one per row.

    Returns:
        Tensors of shape ``(2,)``, float64, in order, each on its row's device.
    """
    out: list[Tensor | None] = [None] * len(raw)
    groups: dict[tuple[torch.device, int], list[int]] = {}
    for i, row in enumerate(raw):
        groups.setdefault((row.device, row.numel()), []).append(i)
    for (device, width), idx in groups.items():
        table = torch.stack([raw[i].double() for i in idx])
        n = torch.tensor([max(counts[i], 1) for i in idx], dtype=torch.float64, device=device)
        shift, total, norm = (table.unbind(1) if width == 3 else (torch.zeros_like(n), *table.unbind(1)))
        rows = torch.stack([shift + total / n, norm * norm - total * total / n], 1)
        for i, row in zip(idx, rows.unbind(0)):
            out[i] = row
    return out  # type: ignore[return-value]


CENTRE_ABOVE = 100.0
"""mean^2 / var above which a tensor's moments need the centred pass (see :func:`sums`)."""


def needs_centring(mean: float, m2: float, n: float) -> bool:
    """Whether a tensor with these moments should take the centred pass next time (see
    :func:`sums`); True for undefined or non-finite values."""
    var = m2 / n if n else 0.0
    return not (math.isfinite(mean) and math.isfinite(var)) or mean * mean > CENTRE_ABOVE * var


def count(x: Tensor) -> int:
    """Number of real elements that :func:`moments` sees in ``x`` (complex counts twice)."""
    return x.numel() * (2 if x.is_complex() else 1)


def _dense_real(x: Tensor) -> Tensor:
    x = x.detach()
    if x.is_sparse:
        x = x.coalesce().to_dense()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return x.reshape(-1)


@dataclass(frozen=True)
class Moments:
    """Host-side moments of one tensor: count ``n`` (0 = absent), ``mean`` and ``m2`` (float)."""

    n: float
    mean: float
    m2: float

    @property
    def std(self) -> float:
        """Sample standard deviation (correction=1); NaN when ``n < 2``."""
        return math.sqrt(max(self.m2, 0.0) / (self.n - 1)) if self.n > 1 else math.nan

    @property
    def sq_norm(self) -> float:
        """Squared L2 norm ``m2 + n * mean^2`` (0 for an empty tensor)."""
        return max(self.m2, 0.0) + self.n * self.mean * self.mean if self.n else 0.0

    @property
    def norm(self) -> float:
        """L2 norm."""
        return math.sqrt(self.sq_norm)

    @property
    def finite(self) -> bool:
        """Whether mean and m2 are finite (False iff some element was NaN or Inf)."""
        return math.isfinite(self.mean) and math.isfinite(self.m2)

    @property
    def all_zero(self) -> bool:
        """Whether every element is exactly zero. The sums run in float32, so updates whose every
        element is below about 1e-19 in magnitude (squares under float32's smallest normal) would
        also read as zero; no optimizer step is that small in practice."""
        return self.mean == 0.0 and self.m2 == 0.0


def log10_ratio(num: Moments, den: Moments) -> float | None:
    """``log10(std(num) / std(den))``, or ``None`` when either std is zero, undefined or not finite."""
    a, b = num.std, den.std
    if not (math.isfinite(a) and math.isfinite(b)) or a <= 0.0 or b <= 0.0:
        return None
    return math.log10(a / b)


def to_host(pieces: list[Tensor]) -> list[list[float]]:
    """Copy 1-D float64 device tensors to the host: one concatenation and one copy per device.

    Args:
        pieces: tensors of shape ``(k_i,)``, dtype float64, on any devices.

    Returns:
        ``pieces[i].tolist()`` for every i, in order. One device-to-host copy per device in total.
    """
    out: list[list[float]] = [[] for _ in pieces]
    by_device: dict[torch.device, list[int]] = {}
    for i, piece in enumerate(pieces):
        by_device.setdefault(piece.device, []).append(i)
    for idx in by_device.values():
        flat = torch.cat([pieces[i] for i in idx]).cpu().tolist()
        start = 0
        for i in idx:
            size = pieces[i].numel()
            out[i] = flat[start:start + size]
            start += size
    return out

"""Numerically stable per-tensor moments, stacked into one table per device, and the figures from it.

Each tensor x contributes a row ``(mean, m2)`` in float64 on its device, with
``m2 = sum((x - mean)^2)`` computed after centring (see :func:`moments`), so a LayerNorm weight
near 1.0 with a spread of 1e-4 keeps its spread (a plain sum-of-squares formula loses it to
cancellation), and its element count n on the host. From a row: ``std = sqrt(m2 / (n - 1))`` (Bessel's correction, as
``torch.std(correction=1)``) and ``||x||_2 = sqrt(m2 + n * mean^2)`` (both terms >= 0: no
cancellation). Rows of disjoint pieces combine exactly by Chan, Golub & LeVeque (1979), which is what
sharded training needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

def moments(x: Tensor, scratch: bool = False) -> Tensor:
    """The ``(mean, m2)`` of ``x`` as a float64 tensor of shape ``(2,)`` on ``x``'s device.

    Two passes: the mean, then the centred values' sum r and norm. Centring first keeps the spread
    of a tensor whose mean dwarfs it (a LayerNorm weight near 1.0 with std 1e-4), and
    ``mean + r/n``, ``||x - mean||^2 - r^2/n`` remove the rounding of the float32 mean (the
    shifted-data formulas, Chan, Golub & LeVeque 1983). Faster on CPU than Welford's single pass
    (``torch.var_mean``).

    Args:
        x: any floating or complex tensor, any shape. Complex counts as pairs of reals, sparse is
            densified, bf16/fp16 is promoted to float32 first. Its element count is
            :func:`count` ``(x)``, which the caller keeps on the host.
        scratch: ``x`` is a temporary the caller drops: centre it in place instead of allocating.

    Returns:
        Tensor of shape ``(2,)``, dtype float64. No host synchronisation.
    """
    dense = _dense_real(x)
    if dense.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=dense.device)
    mean = dense.mean()
    in_place = scratch and not x.is_sparse and dense.data_ptr() == x.data_ptr()
    centred = dense.sub_(mean) if in_place else dense - mean
    return _compensated(mean.reshape(1), centred.sum().reshape(1),
                        torch.linalg.vector_norm(centred).reshape(1), [dense.numel()])[0]


CENTRE_ABOVE = 100.0
"""mean^2 / var above which a tensor's moments need the centred pass (see :func:`moments_many`)."""


def moments_many(xs: list[Tensor], centre: list[bool]) -> list[Tensor]:
    """:func:`moments` of every tensor, the cheap way where that is exact enough.

    Where ``centre[i]`` is False, x_i's row comes from its sum and ``torch._foreach_norm`` over all
    such tensors at once: no temporary, one launch for every norm, and
    ``m2 = ||x||^2 - (sum x)^2 / n`` in float64, whose float32 rounding costs a relative error of
    about 1e-7 * mean^2 / var, below 1e-5 while ``mean^2 / var <= CENTRE_ABOVE``. The caller passes
    True (the centred, two-pass :func:`moments`) for tensors whose mean dwarfs their spread, such as
    LayerNorm weights near 1.0, and for tensors it has not seen yet.

    Args:
        xs: tensors as accepted by :func:`moments`, on any devices and dtypes.
        centre: one flag per tensor.

    Returns:
        One float64 tensor of shape ``(2,)`` per input, in order, on the input's device.
    """
    rows: list[Tensor | None] = [moments(x) if c else None for x, c in zip(xs, centre)]
    fast = [i for i, row in enumerate(rows) if row is None]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    dense = {i: _dense_real(xs[i]) for i in fast}
    for i in fast:
        groups.setdefault((dense[i].device, dense[i].dtype), []).append(i)
    for (device, _), idx in groups.items():
        sums = torch.stack([dense[i].sum() for i in idx]).double()
        squares = torch.stack(torch._foreach_norm([dense[i] for i in idx])).double().square()
        n = torch.tensor([max(dense[i].numel(), 1) for i in idx], dtype=torch.float64, device=device)
        for i, row in zip(idx, torch.stack([sums / n, squares - sums * sums / n], 1).unbind(0)):
            rows[i] = row
    return rows  # type: ignore[return-value]


def needs_centring(mean: float, m2: float, n: float) -> bool:
    """Whether a tensor with these moments should take the centred pass next time (see
    :func:`moments_many`); True for undefined or non-finite values."""
    var = m2 / n if n else 0.0
    return not (math.isfinite(mean) and math.isfinite(var)) or mean * mean > CENTRE_ABOVE * var


def _compensated(means: Tensor, residues: Tensor, norms: Tensor, counts: list[int]) -> Tensor:
    """Rows ``(mean, m2)`` in float64 from the rounded means, the sums r of the centred values and
    their norms: mean + r/n and ||x - mean||^2 - r^2/n, which removes the rounding of the float32
    mean from both (it matters when shards of one parameter are combined)."""
    n = torch.tensor(counts, dtype=torch.float64, device=means.device)
    r = residues.double()
    return torch.stack([means.double() + r / n, norms.double().square() - r * r / n], 1)


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
        """Whether every element is exactly zero (mean and m2 accumulate in float64: no underflow)."""
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

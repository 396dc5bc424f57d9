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

    Two passes: the mean, then ``m2 = ||x - mean||^2``. Centring first keeps the spread of a
    tensor whose mean dwarfs it (a LayerNorm weight near 1.0 with std 1e-4): the rounding of the
    float32 mean adds only ``n * (mean error)^2``, 1e-6 of m2 there. Faster on CPU than Welford's
    single pass (``torch.var_mean``) and as exact to the tolerances used here.

    Args:
        x: any floating or complex tensor, any shape. Complex counts as pairs of reals, sparse is
            densified, bf16/fp16 is promoted to float32 first. Its element count is
            :func:`count` ``(x)``, which the caller keeps on the host.
        scratch: ``x`` is a temporary the caller drops: centre it in place instead of allocating.

    Returns:
        Tensor of shape ``(2,)``, dtype float64. No host synchronisation.
    """
    dense = _dense_real(x)
    mean = dense.mean()
    in_place = scratch and not x.is_sparse and dense.data_ptr() == x.data_ptr()
    centred = dense.sub_(mean) if in_place else dense - mean
    return torch.stack([mean, torch.linalg.vector_norm(centred).square()]).double()


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
        """Squared L2 norm ``m2 + n * mean^2``."""
        return max(self.m2, 0.0) + self.n * self.mean * self.mean

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

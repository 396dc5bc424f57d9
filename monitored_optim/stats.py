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


CHUNK_BYTES = 4 * 2**20
"""Upper bound on the centred copies :func:`moments_many` holds at once (bytes)."""


def moments_many(xs: list[Tensor]) -> list[Tensor]:
    """:func:`moments` of every tensor, batched with ``torch._foreach_*``, in bounded memory.

    Same arithmetic as :func:`moments` (mean, then the sum and norm of the centred values). The
    tensors are cut into contiguous slices (views) and centred in chunks of at most
    ``min(CHUNK_BYTES, total bytes / 32)``, so the temporary copies stay a few percent of the
    inputs' bytes whatever their sizes, with one kernel launch per chunk for the centring and the
    norms instead of several per tensor.

    Args:
        xs: tensors as accepted by :func:`moments`, on any devices and dtypes.

    Returns:
        One float64 tensor of shape ``(2,)`` per input, in order, on the input's device.
    """
    dense = [_dense_real(x) for x in xs]
    rows: list[Tensor] = [torch.zeros(2, dtype=torch.float64, device=x.device) for x in dense]
    owners = [i for i, x in enumerate(dense) if x.numel() > 0]
    if not owners:
        return rows
    limit = max(2**16, min(CHUNK_BYTES, sum(dense[i].numel() * dense[i].element_size() for i in owners) // 32))
    means = {i: dense[i].mean() for i in owners}
    slices = [(i, piece) for i in owners for piece in dense[i].split(max(1, limit // dense[i].element_size()))]
    residues: dict[int, list[Tensor]] = {i: [] for i in owners}
    squares: dict[int, list[Tensor]] = {i: [] for i in owners}
    for chunk in _chunks(slices, limit):
        centred = torch._foreach_sub([piece for _, piece in chunk], [means[i] for i, _ in chunk])
        for (i, _), c, norm in zip(chunk, centred, torch._foreach_norm(centred)):
            residues[i].append(c.sum())
            squares[i].append(norm)
        del centred
    for i in owners:
        r = torch.stack(residues[i]).double().sum()
        q = torch.stack(squares[i]).double().square().sum()
        rows[i] = _compensated(means[i].reshape(1), r.reshape(1), q.sqrt().reshape(1), [dense[i].numel()])[0]
    return rows


def _chunks(slices: list[tuple[int, Tensor]], limit: int):
    """Consecutive runs of slices of one device and dtype whose bytes add up to ``limit`` at most."""
    run: list[tuple[int, Tensor]] = []
    size = 0
    for item in slices:
        x = item[1]
        nbytes = x.numel() * x.element_size()
        if run and (size + nbytes > limit or (x.device, x.dtype) != (run[0][1].device, run[0][1].dtype)):
            yield run
            run, size = [], 0
        run.append(item)
        size += nbytes
    if run:
        yield run


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

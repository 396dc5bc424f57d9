"""Per-layer spikes: a parameter's grad or update jumping far above its recent size.

A spike is a jump in size. For each monitored parameter two magnitudes are judged, both as log10
(so a spike is a factor): ``grad_norm``, the L2 norm of its grad, and ``update_rms_per_lr``, the
root mean square of its update per unit of its group's learning rate,
``log10(||u|| / sqrt(n)) - log10(lr)`` (``lr`` where it is a known positive number, else 1).
Dividing by the lr keeps warmup and decay, which scale every layer's update by design, from
counting. Adam-like optimizers normalise the update, so its RMS per lr stays near 1 whatever the
grad's scale and a blown-up grad shows in ``grad_norm``; under SGD the update follows the grad and
both rise. The update's centred spread (``update_to_data``) is not judged: in a tensor of a few
elements it moves by decades while the update keeps its size.

Against each series' median m and median absolute deviation MAD over its last :data:`WINDOW`
logged values, a value x spikes when it has at least :data:`MIN_HISTORY` values behind it and

    x - m > max(THRESHOLD · 1.4826 · MAD, FLOOR)

(1.4826 · MAD estimates a standard deviation for normal data; FLOOR, a factor of 10, keeps a
parameter whose figure barely moves, or falls steadily early in training, from spiking on noise).
Only a jump up is a spike: the blow-up that comes before a loss spike. A fall is not (a schedule's
decay, a one-element bias whose grad crosses zero); a lasting one shows in ``health/unchanged`` and
``health/no_grad``. A spiking value does not enter the baseline. Computed from the step's moment
table, already on the host: no device work, no sync.
Source: Hampel's identifier (Hampel 1974; Pearson 2002, "Outliers in process modeling and
identification"), one-sided.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._warnings import Once, warn
from .base import Family

WINDOW = 20
MIN_HISTORY = 5
THRESHOLD = 6.0
FLOOR = 1.0
FIGURES = ("grad_norm", "update_rms_per_lr")


class Spikes(Family):
    """``health/spikes``: the number of parameters whose grad norm or update RMS per lr spiked at
    this logging step; a warning names the first parameters to spike, the figures and the step.

    The last :data:`WINDOW` values of every series live in one float64 table (parameters x
    :data:`FIGURES` x window, NaN where empty), so that a logging step's medians and MADs are a few
    ops on the host for all parameters (the median of an even count is the mean of the middle two,
    as ``statistics.median``)."""

    name = "spikes"
    default = True
    run_wide = ("health/spikes",)

    def __init__(self) -> None:
        self._row: dict[str, int] = {}
        self._history = torch.full((0, len(FIGURES), WINDOW), math.nan, dtype=torch.float64)
        self._count = torch.zeros((0, len(FIGURES)), dtype=torch.long)
        self._told = Once()
        self._names: tuple[str, ...] = ()
        self._rows = torch.zeros(0, dtype=torch.long)  # the table rows of _names
        self._all = True  # _rows is every row in order: the table itself, not a gather of it

    def figures(self, step: Any) -> dict[str, float]:
        names = tuple(step.names)
        if names != self._names:  # the same parameters as the last logging step: the same rows
            self._grow(names)
            self._names, self._rows = names, torch.tensor([self._row[name] for name in names], dtype=torch.long)
            self._all = len(names) == len(self._row) and bool((self._rows == torch.arange(len(names))).all())
        rows = self._rows
        x = _values(step.table, step.lrs)
        past, count = (self._history, self._count) if self._all else (self._history[rows], self._count[rows])
        median = _median(past, count)
        rise = x - median
        spike = (count >= MIN_HISTORY) & x.isfinite() & (rise > FLOOR)  # the bound is at least FLOOR
        r, k = spike.nonzero(as_tuple=True)  # the MAD only where a value may spike (usually nowhere)
        if len(r):
            mad = _median((past[r, k] - median[r, k].unsqueeze(-1)).abs(), count[r, k])
            spike[r, k] = rise[r, k] > torch.clamp(THRESHOLD * 1.4826 * mad, min=FLOOR)
        keep = x.isfinite() & ~spike  # a spiking value does not enter the baseline
        r, k = keep.nonzero(as_tuple=True)
        self._history[rows[r], k, count[r, k] % WINDOW] = x[r, k]
        self._count[rows[r], k] += 1
        spiking = [(names[i], [kind for kind, hit in zip(FIGURES, spike[i].tolist()) if hit])
                   for i in spike.any(1).nonzero().flatten().tolist()]  # only the spiking rows read back
        if spiking and self._told.first():
            shown = ", ".join(f"{name!r} ({' and '.join(kinds)})" for name, kinds in spiking[:5])
            more = f" and {len(spiking) - 5} more" if len(spiking) > 5 else ""
            warn(f"monitored_optim: spike at step {step.step} in {shown}{more}: far above each one's "
                 f"last {WINDOW} logged values (health/spikes counts them at every logging step)", RuntimeWarning)
        return {"health/spikes": float(len(spiking))}

    def _grow(self, names: tuple[str, ...]) -> None:
        """Rows for names not seen before."""
        new = [name for name in names if name not in self._row]
        if not new:
            return
        self._row.update({name: len(self._row) + i for i, name in enumerate(new)})
        self._history = torch.cat([self._history, torch.full((len(new), len(FIGURES), WINDOW), math.nan,
                                                             dtype=torch.float64)])
        self._count = torch.cat([self._count, torch.zeros((len(new), len(FIGURES)), dtype=torch.long)])


def _values(table: Any, lrs: list[float | None]) -> Tensor:
    """Per parameter, the magnitudes spikes are judged on (:data:`FIGURES`), float64 of shape
    ``(N, 2)``: log10 of the grad norm, and log10 of the update's RMS ``||u|| / sqrt(n)`` less log10
    of its group's lr where that is a known positive float (``lrs``, one per parameter); NaN where a
    norm is zero (no grad, no update). From the step's :class:`~monitored_optim.reduce.MomentTable`
    (kinds p, grad, u)."""
    sizes = torch.stack([table.norm[:, 1], table.norm[:, 2] / table.n[:, 0].clamp(min=1).sqrt()], 1)
    logs = {lr: math.log10(lr) if lr is not None and lr > 0 else 0.0 for lr in set(lrs)}  # one per group
    per_lr = torch.tensor([logs[lr] for lr in lrs], dtype=torch.float64).reshape(-1)
    values = torch.where(sizes > 0, sizes.log10(), math.nan)
    values[:, 1] -= per_lr
    return values


def _median(values: Tensor, count: Tensor) -> Tensor:
    """Median of the first ``min(count, WINDOW)`` non-NaN entries along the last dimension (NaN
    sorts last), the mean of the middle two for an even number; NaN where there are none.

    ``values``: a float64 tensor ``(..., WINDOW)``; ``count``: int64 of its leading shape. The rows
    are sorted by NumPy on the host (cheaper than ``torch.sort``, whose cost goes per row)."""
    n = count.clamp(max=WINDOW)
    ordered = torch.from_numpy(np.sort(values.cpu().numpy(), -1)).to(values.device)
    lo = ((n - 1).clamp(min=0) // 2).unsqueeze(-1)
    hi = (n // 2).clamp(max=WINDOW - 1).unsqueeze(-1)
    middle = (ordered.gather(-1, lo) + ordered.gather(-1, hi)).squeeze(-1) / 2
    return torch.where(n > 0, middle, math.nan)

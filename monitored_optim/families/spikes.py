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

from .._warnings import Once
from ..hosted import MomentTable
from .base import Family, Step

WINDOW = 20
"""Values of each series the median and MAD are taken over: the last ones admitted."""
MIN_HISTORY = 5
"""Values a series holds before any of its values may spike."""
THRESHOLD = 6.0
"""Robust standard deviations (1.4826 · MAD) above the median a spike must reach."""
FLOOR = 1.0
"""The least rise that spikes, in log10: a factor of 10."""
FIGURES = ("grad_norm", "update_rms_per_lr")
"""The figures the ``spikes`` family judges for each parameter."""


class SpikeRule:
    """Hampel's one-sided identifier over the last :data:`WINDOW` values admitted to each series.

    Series are keyed by a name and hold ``width`` values each (one per figure judged). The last
    :data:`WINDOW` values of every series live in one float64 table (series x width x window, NaN
    where empty), so that a step's medians and MADs are a few ops on the host for every series (the
    median of an even count is the mean of the middle two, as ``statistics.median``). Judging reads
    the table; only :meth:`admit` writes it, so a caller decides which judged values enter.

    Args:
        width: values per series (int >= 1).
    """

    def __init__(self, width: int) -> None:
        self.width = width
        self._row: dict[str, int] = {}
        self._history = torch.full((0, width, WINDOW), math.nan, dtype=torch.float64)
        self._count = torch.zeros((0, width), dtype=torch.long)
        self._names: tuple[str, ...] | None = None  # the names last judged (None: none since built or loaded)
        self._rows = torch.zeros(0, dtype=torch.long)  # the table rows of _names
        self._all = True  # _rows is every row in order: the table itself, not a gather of it

    def judge(self, names: tuple[str, ...], x: Tensor) -> Tensor:
        """Which values of ``x`` (float64, ``(len(names), width)``, log10 sizes; NaN where unknown)
        spike: at least :data:`MIN_HISTORY` values behind them and ``x - median`` above
        ``max(THRESHOLD * 1.4826 * MAD, FLOOR)``. A +inf value with enough history spikes; NaN never.

        Returns a bool tensor of the shape of ``x``."""
        if names != self._names:  # the same series as the last call: the same rows
            self._grow(names)
            self._names, self._rows = names, torch.tensor([self._row[name] for name in names], dtype=torch.long)
            self._all = len(names) == len(self._row) and bool((self._rows == torch.arange(len(names))).all())
        past, count = self._past()
        median = _median(past, count)
        rise = x - median
        spike = (count >= MIN_HISTORY) & (rise > FLOOR)  # the bound is at least FLOOR; NaN compares False
        r, k = spike.nonzero(as_tuple=True)  # the MAD only where a value may spike (usually nowhere)
        if len(r):
            mad = _median((past[r, k] - median[r, k].unsqueeze(-1)).abs(), count[r, k])
            spike[r, k] = rise[r, k] > torch.clamp(THRESHOLD * 1.4826 * mad, min=FLOOR)
        return spike

    def admit(self, x: Tensor, keep: Tensor) -> None:
        """Enter the values of ``x`` where ``keep`` (bool, the shape of ``x``) into the series of the
        names last judged."""
        r, k = keep.nonzero(as_tuple=True)
        count = self._count if self._all else self._count[self._rows]
        self._history[self._rows[r], k, count[r, k] % WINDOW] = x[r, k]
        self._count[self._rows[r], k] += 1

    def state_dict(self) -> dict[str, Any]:
        """Its series (names, history, counts), to resume with (:meth:`load_state_dict`)."""
        return {"names": list(self._row), "history": self._history.clone(), "count": self._count.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`state_dict` gave."""
        self._row = {name: i for i, name in enumerate(state["names"])}
        self._history, self._count = state["history"].clone(), state["count"].clone()
        self._names = None  # rows found again at the next judging

    def _past(self) -> tuple[Tensor, Tensor]:
        """The history and counts of the names last judged, in their order."""
        if self._all:
            return self._history, self._count
        return self._history[self._rows], self._count[self._rows]

    def _grow(self, names: tuple[str, ...]) -> None:
        """Rows for names not seen before."""
        new = [name for name in names if name not in self._row]
        if not new:
            return
        self._row.update({name: len(self._row) + i for i, name in enumerate(new)})
        self._history = torch.cat([self._history, torch.full((len(new), self.width, WINDOW), math.nan,
                                                             dtype=torch.float64)])
        self._count = torch.cat([self._count, torch.zeros((len(new), self.width), dtype=torch.long)])


class Spikes(Family):
    """``health/spikes``: the number of parameters whose grad norm or update RMS per lr spiked at
    this logging step (:class:`SpikeRule` over its logging steps); the run's voice names the first
    parameters to spike, the figures and the step (a warning once, a ``spikes`` event each time)."""

    name = "spikes"
    default = True
    run_wide = ("health/spikes",)

    def __init__(self) -> None:
        self.rule = SpikeRule(len(FIGURES))
        self._told = Once()

    def figures(self, step: Step) -> dict[str, float]:
        names = tuple(step.names)
        x = _values(step.table, step.lrs)
        spike = self.rule.judge(names, x) & x.isfinite()
        self.rule.admit(x, x.isfinite() & ~spike)  # a spiking value does not enter the baseline
        rows = spike.any(1).nonzero().flatten().tolist()  # only the spiking rows read back
        spiking = [(names[i], [kind for kind, hit in zip(FIGURES, spike[i].tolist()) if hit]) for i in rows]
        if spiking:
            layers = [f"{name} ({' and '.join(f'{kind} 10^{x[i, FIGURES.index(kind)].item():.2f}' for kind in kinds)})"
                      for i, (name, kinds) in zip(rows, spiking)]
            self.voice.event("spikes", step.step, layers)
            if self._told.first():
                shown = ", ".join(f"{name!r} ({' and '.join(kinds)})" for name, kinds in spiking[:5])
                more = f" and {len(spiking) - 5} more" if len(spiking) > 5 else ""
                self.voice.warn(f"monitored_optim: spike at step {step.step} in {shown}{more}: far above each "
                                f"one's last {WINDOW} logged values (health/spikes counts them at every logging step)")
        return {"health/spikes": float(len(spiking))}


def _values(table: MomentTable, lrs: list[float | None]) -> Tensor:
    """Per parameter, the magnitudes spikes are judged on (:data:`FIGURES`), float64 of shape
    ``(N, 2)``: log10 of the grad norm, and log10 of the update's RMS ``||u|| / sqrt(n)`` less log10
    of its group's lr where that is a known positive float (``lrs``, one per parameter); NaN where a
    norm is zero (no grad, no update). From the step's :class:`~monitored_optim.hosted.MomentTable`
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

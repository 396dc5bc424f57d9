"""Histograms of each parameter's stored change u, its grad and its value after the step.

``update_hist/{name}``, ``grad_hist/{name}`` and ``param_hist/{name}``: the counts of the elements
of u = p_after - p_before, of the grad the step used (after clipping; unscaled where a fused
GradScaler step passes its scale) and of p after the step, in the fixed bins of
:mod:`monitored_optim.histograms`. The capture bins each part of a parameter in its own pass
(:class:`~monitored_optim.capture.eager.Eager`); counts add over parts and, under
``torch.distributed``, over ranks (SUM pieces of width :data:`~monitored_optim.histograms.NBINS`).
They are not scalar figures: they go to ``opt.monitor.histograms`` and the backends' histograms.
"""

from __future__ import annotations

from typing import Any

from ..histograms import KEYS, NBINS
from ..pieces import SUM
from .base import Family


class Histograms(Family):
    """The ``histograms`` family (see the module docstring)."""

    pieces = {key: SUM for key in KEYS.values()}
    widths = {key: NBINS for key in KEYS.values()}
    binned = True

    def figures(self, step: Any) -> dict[str, float]:
        return {}

"""Histograms of each parameter's stored change u, its grad and its value after the step.

``update_hist/{name}``, ``grad_hist/{name}`` and ``param_hist/{name}``: the counts of the elements
of u = p_after - p_before, of the grad the step used (after clipping; unscaled where a fused
GradScaler step passes its scale) and of p after the step, in the fixed bins of
:mod:`monitored_optim.histograms`, with the min, max, sum and sum of squares of the same elements.
The capture counts each part of a parameter as it makes it, and folds and adds the parts' counts
once per logging step (:class:`~monitored_optim.capture.binning.Tally`); counts and sums add over
parts and, under ``torch.distributed``, over ranks, and the extremes are the least and the greatest
(:data:`~monitored_optim.histograms.PIECES`).
They are not scalar figures: they go to ``opt.monitor.histograms`` and the backends' histograms.
"""

from __future__ import annotations


from ..histograms import KEYS, PIECES, WIDTHS
from .base import Family, Step


class Histograms(Family):
    """The ``histograms`` family (see the module docstring)."""

    name = "histograms"
    series = tuple(KEYS.values())
    pieces = PIECES
    widths = WIDTHS
    binned = True

    def figures(self, step: Step) -> dict[str, float]:
        return {}

"""Figure families beyond the core figures: per-layer spikes, optimizer-state health, spectral size,
histograms.

Each family is a small object registered in :data:`REGISTRY` under its name in
``MonitorConfig(figures=...)``. The monitor calls, for the families the configuration turns on:

* ``part(name, whole, u, span, state, group)``, on the device, for each part of a parameter right
  after its stored change ``u`` is formed (``span``: the flat slice of ``whole`` that ``u`` and the
  ``state`` slices cover, or None for the whole parameter); returns device pieces, a dict of 1-D
  float64 tensors, that go to the host in the logging step's one copy (or, under
  ``torch.distributed``, its one collective), combined over parts and ranks as the family's
  ``pieces`` declare (:mod:`monitored_optim.pieces`);
* ``done()``, after the last part of the logging step: device pieces per parameter name that need
  all of a parameter's parts (the spectral family's power iteration over blocks of rows);
* ``figures(step)``, on the host, with the :class:`~monitored_optim.families.base.Step` of the logging
  step; returns figures.

A family keeps what it needs between logging steps (a baseline, a warm-started vector) itself.
"""

from __future__ import annotations

from ..alerts import Voice
from .base import Family, Step
from .histograms import Histograms
from .spectral import Spectral
from .spikes import Spikes
from .state import OptimizerState


REGISTRY: dict[str, type[Family]] = {cls.name: cls for cls in (Spikes, OptimizerState, Spectral, Histograms)}
"""Family name (as in ``MonitorConfig.figures``) -> its class, built once per monitor."""

def build(chosen: frozenset[str]) -> list[Family]:
    """One instance of each registered family that ``chosen`` turns on."""
    return [cls() for name, cls in REGISTRY.items() if name in chosen]


def speak(chosen: list[Family], voice: Voice) -> None:
    """Give the ``chosen`` families the run's voice, which warns and tells events where the figures
    are written."""
    for family in chosen:
        family.voice = voice


__all__ = ["REGISTRY", "Family", "Step", "build", "speak"]

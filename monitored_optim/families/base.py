"""The base of a figure family: no device work unless it says so (see ``families/__init__.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..alerts import Voice
from ..hosted import MomentTable


@dataclass(frozen=True)
class Step:
    """A logging step as the families see it, one row per monitored parameter.

    Attributes:
        step: the optimizer step (int >= 1).
        names: parameter names, in order.
        table: their moments (:class:`~monitored_optim.hosted.MomentTable`, kinds p, grad, u).
        pieces: per parameter, the host values of its device pieces (``{key: [floats]}``).
        lrs: per parameter, its group's learning rate as a float (None where it has none).
        shapes: per parameter, its (whole) shape.
    """

    step: int
    names: list[str]
    table: MomentTable
    pieces: list[dict[str, list[float]]]
    lrs: list[float | None]
    shapes: list[Any]


class Family:
    """A figure family: its name, its tags, its device pieces and their reductions, its figures.

    ``part`` and ``done`` return no device pieces unless a family overrides them; every family
    defines ``figures``. :mod:`monitored_optim.tags` reads the names and tags of the registered
    families (:data:`monitored_optim.families.REGISTRY`)."""

    name = ""
    """Its name in ``MonitorConfig(figures=...)``."""

    default = False
    """Whether it is among the families sent by default."""

    series: tuple[str, ...] = ()
    """The heads of its per-parameter tags (``update_spectral`` for ``update_spectral/{name}``)."""

    keyed: tuple[str, ...] = ()
    """Those of :attr:`series` followed by a key before the parameter's name (``state_norm/exp_avg/{name}``)."""

    run_wide: tuple[str, ...] = ()
    """Its run-wide tags, under another family's head (``health/spikes``)."""

    pieces: dict[str, str] = {}
    """Every key its device pieces may have -> its reduction (:mod:`monitored_optim.pieces`); a key
    ``head:anything`` reduces as its head's."""

    widths: dict[str, int] = {}
    """Values per parameter of each SUM key of ``pieces`` that holds more than one."""

    voice = Voice()
    """The run's voice (:func:`~monitored_optim.families.speak`): warnings about the figures, and events,
    told where the figures are written; by default, a voice that warns in this process."""

    binned = False
    """Whether the capture bins p, the grad and u of every part for this family
    (:mod:`monitored_optim.histograms`; the ``histograms`` family)."""

    def part(self, name: str, whole: Tensor, u: Tensor, span: slice | None, state: dict[str, Any],
             group: dict[str, Any]) -> dict[str, Tensor]:
        """Device pieces of one part of parameter ``name`` (1-D float64 tensors), from its stored
        change ``u`` and its ``state`` slice; none by default."""
        return {}

    def done(self) -> dict[str, dict[str, Tensor]]:
        """Device pieces per parameter name once all parts are in; none by default."""
        return {}

    def figures(self, step: Step) -> dict[str, float]:
        """Host figures of the logging step."""
        raise NotImplementedError

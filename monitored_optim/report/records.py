"""The records of the report: a parameter, its row's figures, the run-wide counts, the healthy band."""

from __future__ import annotations

from dataclasses import dataclass, field

HEALTHY_BAND = (-4.0, -2.0)
"""Update-to-data ratios (log10) inside this closed band count as healthy; -3 is the rule of thumb."""
REFERENCE = -3.0
HEALTH = "health"
"""Kind of the run-wide health counts (``health/no_grad``, ``health/unchanged``, ...)."""
GUARD = "guard"
"""Kind of the guard's run-wide count (``guard/skipped``), shown beside the health counts."""


@dataclass(frozen=True)
class Param:
    """A monitored parameter: its tag ``prefix`` (``""`` or ``"gen/"``) and ``name``."""

    prefix: str
    name: str

    @property
    def label(self) -> str:
        """``prefix + name``, how the report shows it (``fc1.weight``, ``gen/fc1.weight``)."""
        return self.prefix + self.name

    def tag(self, kind: str) -> str:
        """The tag of this parameter's ``kind`` figure (``update_to_data/fc1.weight``)."""
        return f"{self.prefix}{kind}/{self.name}"


@dataclass(frozen=True)
class Figure:
    """One tag over the window: ``latest`` at the run's last logged step and ``median`` over the
    window's logged values; either is ``None`` when the tag has no value there."""

    latest: float | None
    median: float | None


@dataclass(frozen=True)
class Count:
    """A run-wide ``health/`` count: ``latest`` at the run's last logged step and ``worst``, the
    maximum over the window; either is ``None`` when the tag has no value there."""

    latest: float | None
    worst: float | None


@dataclass
class Layer:
    """One parameter's row.

    Attributes:
        name: the parameter's label: its name, after the tag prefix if any (``gen/fc1.weight``).
        update_to_data, grad_to_data: log10 ratios (healthy update-to-data near -3 for matrices).
        update_norm: L2 norm of the update, in parameter units.
        kind: ``"matrix"`` (ndim >= 2, embeddings included) or ``"vector"`` (biases, norm gains,
            scalars): from the run's ``params.json``, else guessed from the name
            (:func:`~monitored_optim.report.summary.kind_of`).
        marks: short warnings (see :func:`~monitored_optim.report.summary.summarize`); empty for a
            healthy layer.
    """

    name: str
    update_to_data: Figure
    grad_to_data: Figure
    update_norm: Figure
    kind: str = "matrix"
    marks: list[str] = field(default_factory=list)

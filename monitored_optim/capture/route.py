"""The route of a monitored parameter: how the capture takes its p_before and u at a logging step.

The :class:`~monitored_optim.capture.plan.Plan` decides each parameter's route once, from the
tensors' metadata (:class:`Planned`); at a logging step only the snapshot rule's rounding risk and
whether the grad is dense can change it (:meth:`Planned.route`). The capture takes that route,
:func:`~monitored_optim.describe.describe` shows it and the ``monitor/`` figures count it:

=================  ================================================================================
route              p_before and u
=================  ================================================================================
``FLAT``           small float32/float64 parameters: p_before copied into one flat buffer per chunk
``FUSED_COPY``     a compiled copy of p_before (the snapshot rule's), u = p_after - p_before
``FUSED_REBUILD``  u rebuilt by the view's fused form, the store's rounding inverted, compiled
``SNAPSHOT``       an eager copy of p_before (the snapshot rule's), u = p_after - p_before
``VIEW``           u rebuilt by the view, the store's rounding inverted (in slices where large)
``CLONED``         a clone of p_before: no view for this optimizer, or a shard its view cannot rebuild
``SKIPPED``        none: an integer tensor, never stepped
=================  ================================================================================
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from .rules import snapshot_reason

SMALL = 1 << 12
"""Elements up to which a parameter is captured *flat* (eagerly, compiling or not): copied whole into one flat
buffer with the other small parameters of its chunk before the step (its exact snapshot), so that a
chunk of thousands of biases and norm gains costs a few ops, not a few per tensor."""

FLAT, FUSED_COPY, FUSED_REBUILD, SNAPSHOT, VIEW, CLONED, SKIPPED = (
    "flat", "fused copy", "fused rebuild", "snapshot", "view", "clone", "skipped")
"""The routes (see the module docstring)."""

INTEGER = "integer tensor: never stepped"
"""Why an integer tensor (a frozen quantized weight) is skipped."""


class Route(NamedTuple):
    """The route one parameter takes at a logging step (the module docstring's table), and why.

    Attributes:
        kind: one of :data:`FLAT`, :data:`FUSED_COPY`, :data:`FUSED_REBUILD`, :data:`SNAPSHOT`,
            :data:`VIEW`, :data:`CLONED` and :data:`SKIPPED`.
        reason: the snapshot rule's reason (:func:`~monitored_optim.capture.rules.snapshot_reason`)
            for a snapshot, why it is cloned for a clone, why it is skipped, else None.
        slices: how many slices the capture cuts it into (1: whole; an eager route of an element-wise
            view only, :func:`~monitored_optim.capture.change.slices`).
    """

    kind: str
    reason: str | None = None
    slices: int = 1

    def label(self, view: str) -> str:
        """How ``describe()`` and the cost figures name it (``view``: the view's class name):
        ``clone (why)``, ``snapshot (why)``, ``view (AdamView)`` (with ``, in N slices`` where it is
        cut), ``, fused`` after a fused route, ``copied flat (...)``, ``skipped (why)``."""
        if self.kind == FLAT:
            return f"copied flat (at most {SMALL:,} elements)"
        if self.kind in (CLONED, SKIPPED):
            return f"{self.kind} ({self.reason})"
        if self.kind in (SNAPSHOT, FUSED_COPY):
            base = f"snapshot ({self.reason})"
        else:
            base = f"view ({view})" + (f", in {self.slices} slices" if self.slices > 1 else "")
        return base + (", fused" if self.kind in (FUSED_COPY, FUSED_REBUILD) else "")


class Planned(NamedTuple):
    """One monitored parameter not captured flat, as the plan has it.

    Attributes:
        name: its name.
        p: the tensor.
        fused: the fused way that may take it whole at a logging step where its grad is dense
            (``"copy"``: the snapshot rule's copy; ``"rebuild"``: also the view's fused form), or
            None (eager).
        aliased: whether another parameter shares its storage (the snapshot rule's ``aliased``).
        slices: how many slices its eager route is cut into.
        fixed: its route whatever the logging step (a clone, an integer tensor skipped), or None.
    """

    name: str
    p: Tensor
    fused: str | None
    aliased: bool
    slices: int
    fixed: Route | None

    def route(self, risky: bool, dense_grad: bool = True) -> Route:
        """Its route at a logging step where the snapshot rule's rounding risk is ``risky``
        (:meth:`Capture.risky <monitored_optim.capture.Capture.risky>`) and its grad is dense or not
        (a sparse or missing one has no fused form)."""
        if self.fixed is not None:
            return self.fixed
        reason = snapshot_reason(self.p, self.aliased, risky)
        if self.fused is not None and dense_grad:
            if reason is not None:
                return Route(FUSED_COPY, reason)
            if self.fused == "rebuild":
                return Route(FUSED_REBUILD)
        return Route(SNAPSHOT if reason is not None else VIEW, reason, self.slices)

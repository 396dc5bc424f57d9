"""What the monitor spent on a logging step, and the route each parameter actually took there.

One small :class:`Record` per logging step, owned by the capture (:attr:`Capture.spent
<monitored_optim.capture.Capture>`): the bytes the capture copied of p_before (clones, snapshots,
the flat chunks' buffers, verify mode's clones), counted on the host from the copies' element counts
and element sizes (no device work, no host read); the host time of the monitor's own stages,
``time.perf_counter()`` around each (:func:`stage`); and per parameter the route it took, for
``describe()``. The figures are the ``monitor`` family (:data:`~monitored_optim.tags.FAMILIES`):

* ``monitor/copied_bytes``: bytes of p_before copied at this step (under ``torch.distributed``, all
  ranks' copies, summed in the one collective);
* ``monitor/host_seconds``: host time of the capture before and after the base step and of the
  reduction and figures, up to the figures' delivery (the backends' writing is not in it: it
  follows); under ``torch.distributed`` the mean over the ranks of their time up to the collective.
  On an asynchronous device (CUDA) this is the time to *launch* the work, plus the one
  device-to-host copy's wait.

A step that does not log makes no record and reads no clock.
"""

from __future__ import annotations

import functools
import gc
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from ..stats import Batch
from .route import FUSED_REBUILD, VIEW, Route

COPIED_BYTES, HOST_SECONDS = "monitor/copied_bytes", "monitor/host_seconds"
"""The tags of the ``monitor`` family."""


@dataclass(eq=False)
class Record:
    """One logging step's costs and routes.

    Attributes:
        key: a weak reference to the step's batch of sums (a logging step's own object: a new one
            opens a new record; weak, so that the batch and its buffers die with the step).
        step: the optimizer step it logged, once it finished (None before).
        copied: bytes of p_before copied (int).
        seconds: host seconds of the monitor's stages so far.
        routes: parameter name -> the route it took, as ``describe()`` shows it.
    """

    key: Callable[[], Any]
    step: int | None = None
    copied: int = 0
    seconds: float = 0.0
    routes: dict[str, str] = field(default_factory=dict)


class Spent:
    """The capture's per-step records: :attr:`now` (the logging step in progress, or the last one)
    and :attr:`last` (the last finished logging step's, None before the first)."""

    def __init__(self) -> None:
        self.now: Record | None = None
        self.last: Record | None = None
        self._since: float | None = None  # perf_counter at the start of the stage in progress

    def record(self, key: Batch) -> Record:
        """The record of the logging step whose batch is ``key``: the one in progress, else a new one."""
        if self.now is None or self.now.key() is not key:
            self.now = Record(weakref.ref(key))
        return self.now

    def copied(self, tensors: Iterable[Tensor | None]) -> None:
        """Count the bytes of ``tensors`` (copies of p_before; None: none) in the record in progress."""
        assert self.now is not None, "a copy counted outside a logging step"
        self.now.copied += sum(nbytes(t) for t in tensors if t is not None)

    def so_far(self) -> tuple[float, float]:
        """``(bytes copied, host seconds)`` of the record in progress, its host time up to now
        (zeros where no record is open)."""
        if self.now is None:
            return 0.0, 0.0
        seconds = self.now.seconds + (0.0 if self._since is None else time.perf_counter() - self._since)
        return float(self.now.copied), seconds

    def figures(self, chosen: Iterable[str], reduced: tuple[float, float] | None = None) -> dict[str, float]:
        """The ``monitor`` family's figures of the record in progress (empty where the family is not in
        ``chosen`` or no record is open), its host time up to now; ``reduced``: the figures summed over
        the ranks by the one collective (bytes: all ranks' copies; seconds: their mean), so that every
        rank has the same."""
        if "monitor" not in chosen or self.now is None:
            return {}
        copied, seconds = self.so_far() if reduced is None else reduced
        return {COPIED_BYTES: copied, HOST_SECONDS: seconds}


def nbytes(t: Tensor) -> int:
    """Bytes of ``t``'s elements, from its metadata alone."""
    return t.numel() * t.element_size()


class Staged(Protocol):
    """What :func:`stage` reads of the object whose method it decorates (a :class:`~monitored_optim.flow.Flow`)."""

    @property
    def spent(self) -> Spent:
        """The record of the logging steps' cost."""

    @property
    def step(self) -> int:
        """The optimizer step."""


def stage(last: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a stage of a logging step (a method of a :class:`Staged` object, a
    :class:`~monitored_optim.flow.Flow`, whose ``spent`` it reads): it runs outside compiled graphs
    (``torch.compiler.disable``) with Python's cyclic garbage collector paused (a stage's few objects
    per parameter, freed by reference counting, would otherwise trigger collections that scan the
    training process's whole heap), and its host time goes into the step's record. ``last``: the stage
    that ends the logging step, after which its record is :attr:`Spent.last`."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(staged: Staged, *args: Any, **kwargs: Any) -> Any:
            spent, was_on, start = staged.spent, gc.isenabled(), None
            try:  # paused inside, resumed first: a KeyboardInterrupt raised anywhere here leaves it on
                gc.disable()
                spent._since = start = time.perf_counter()
                return fn(staged, *args, **kwargs)
            finally:
                if was_on:
                    gc.enable()
                spent._since = None
                if spent.now is not None and start is not None:  # opened by the capture before the step
                    spent.now.seconds += time.perf_counter() - start
                    if last:
                        spent.last, spent.now.step = spent.now, staged.step
        return torch.compiler.disable(run)
    return wrap


def taken(route: Route, view: str, snapshots: list[Any]) -> str:
    """The route one parameter took at a logging step, as ``describe()`` shows it.

    Args:
        route: its route (:meth:`~monitored_optim.capture.route.Planned.route`), cut into as many
            slices as it has parts.
        view: the view's class name.
        snapshots: the snapshot of each of its parts as the view's ``before`` left it: a
            :class:`~monitored_optim.updates.Cloned` where the view fell back to a copy of p_before,
            a :class:`~monitored_optim.updates.Summed` where it replayed the step for its sums
            (``replayed``; the sums of a parameter's turn are the route itself).
    """
    from ..updates import Cloned, Summed

    if route.kind not in (VIEW, FUSED_REBUILD):
        return route.label(view)
    n = len(snapshots)
    cloned = sum(isinstance(s, Cloned) for s in snapshots)
    summed = sum(isinstance(s, Summed) and s.replayed for s in snapshots)  # a turn's sums are its route

    def of(k: int) -> str:
        return "" if n == 1 else f" ({k} of {n} parts)"

    told = []
    if cloned:
        told.append(f"clone{of(cloned)}: the view fell back to a copy of p_before (it cannot rebuild this step)")
    if summed:
        told.append(f"replayed sums{of(summed)}: the view fell back to replaying the step for its sums "
                    "(its rebuild would miss the stored change), no copy")
    if not told:
        return route.label(view)
    return "; ".join(told) if cloned + summed == n and n == 1 else route._replace(slices=1).label(view) + ", " \
        + "; ".join(told)

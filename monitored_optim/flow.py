"""The stages of one monitored step, as every stepper (:mod:`monitored_optim.engine`) runs them.

A step that does not log calls the base step and counts it, nothing else. A logging step runs
these stages, each a call into the module that owns it:

1. cadence: is this a logging step? (:meth:`Flow.begin`)
2. plan and capture before the step: each parameter's p_before by its route, and the sums of
   p_before and the grads (:class:`~monitored_optim.capture.Capture`, ``before``);
3. the base step, called once (its hooks fire once) (:meth:`Flow.part`);
4. capture after the step: each stored change u and its sums (``Capture.after``);
5. reduce: one device-to-host copy, or under ``torch.distributed`` one all_reduce
   (:func:`monitored_optim.reduce.gather`, :mod:`monitored_optim.distributed`) (:meth:`Flow.end`);
6. figures (:class:`~monitored_optim.figures.Figures`), then the capture rules' memories for the
   next logging step (``Capture.remember``);
7. deliver: ``latest``, the history, ``params.json`` and the backends, on the writing rank
   (:class:`monitored_optim.deliver.Delivery`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import distributed, histograms, reduce, stats
from ._warnings import Once
from .capture import Capture, closure_of, with_grads_of_closure
from .capture.plan import Entries, Stepped, selected, tell_unmapped
from .capture.spent import Spent, stage
from .config import Settings
from .count import StepCount
from .deliver import Delivery
from .distributed.deepspeed import Layout
from .figures import Figures, group_lrs
from .guard import Guard
from .health import Health
from .models import Models
from .pieces import Keys
from .workspace import Workspace


class Flow:
    """The stages of a step: a logging step's capture around each base step, then its figures.

    Args:
        settings: the monitor's checked settings.
        capture: the monitor's capture (its view bound to the optimizer by the engine).
        figures: what turns the step's host values into figures.
        keys: every piece key and its reduction (the sharded table's rows).
        count: the step count, whose increments the flow asks for.
        delivery: where the figures go.
        health: the health tracker (skipped steps, watched models).
        guard: the guard, or None.
        models: the parameters' names after the models, and the models watched.
        closure_first: the optimizer's ``step`` takes the closure as its first argument.
        closure_ahead: its ``step`` calls the closure before anything else (torch's own), so the guard
            may run it ahead of the step to judge the grads it makes.
    """

    def __init__(self, settings: Settings, capture: Capture, figures: Figures, keys: Keys, count: StepCount,
                 delivery: Delivery, health: Health, guard: Guard | None, models: Models, closure_first: bool,
                 closure_ahead: bool) -> None:
        self.settings, self.capture, self._figures, self._keys = settings, capture, figures, keys
        self._count, self._delivery, self.health, self.guard = count, delivery, health, guard
        self.models, self.closure_first, self.closure_ahead = models, closure_first, closure_ahead
        self.told = Once()  # unnamed and unmapped parameters
        self._ranks = distributed.Ranks()  # the names every rank monitors, once exchanged
        self._guarded: tuple[tuple[int, ...], list[tuple[str, torch.Tensor]]] = ((), [])  # the params it judges

    @property
    def step(self) -> int:
        """Optimizer steps completed (the step a stage's record is of, :func:`~monitored_optim.capture.spent.stage`)."""
        return self._count.step

    @property
    def spent(self) -> Spent:
        """The record of the logging steps' cost (the capture's)."""
        return self.capture.spent

    def skipped(self) -> None:
        """Count a step that an AMP GradScaler or DeepSpeed skipped (the guard's are counted by
        :meth:`guard_skips`)."""
        self.health.skipped_steps += 1
        self._count.skipped()

    @torch.compiler.disable
    def guard_skips(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[bool, tuple[Any, ...], dict[str, Any], Any]:
        """Whether the guard skips this step (counted as a step under ``count="calls"``), judged after the
        closure the call passes has run; returns that, the call's arguments and the closure's loss
        (:meth:`~monitored_optim.guard.Guard.ahead`)."""
        assert self.guard is not None  # asked only with the guard on
        key = (*(id(p) for group in optimizer.param_groups for p in group["params"]), len(self.models.names))
        if key != self._guarded[0]:  # param groups or names changed (watch): name and choose again
            self._guarded = key, selected(optimizer, self.models.names, self.settings.select)[1]
        closure = closure_of(args, kwargs, self.closure_first) if self.closure_ahead else None  # else: the step's
        skips, args, kwargs, loss = self.guard.ahead(self._guarded[1], args, kwargs, closure,
                                                     getattr(optimizer, "grad_scale", None), self._count.step + 1)
        if skips:
            self._count.skipped()
        return skips, args, kwargs, loss

    def begin(self, optimizer: torch.optim.Optimizer, layout: Layout | None = None) -> Pending | None:
        """Begin a step: on a logging step, its sharding (``layout``: DeepSpeed's, which lists what this
        rank holds itself) and its batch of sums; None on another step."""
        return self._open(optimizer, layout) if self._count.logs_next() else None

    @torch.compiler.disable
    def _open(self, optimizer: torch.optim.Optimizer, layout: Layout | None) -> Pending:
        return Pending(optimizer, distributed.sharding(optimizer, layout), stats.Batch(Workspace()))

    def part(self, optimizer: torch.optim.Optimizer, pending: Pending | None, step_fn: Callable[..., Any],
             args: tuple[Any, ...], kwargs: dict[str, Any], groups: set[int] | None = None
             ) -> tuple[Any, Entries | None]:
        """Call the base step ``step_fn(optimizer, *args, **kwargs)`` once, within the step ``pending``
        begun: on a logging step, captured before and after (the param groups ``groups``, None: all).
        Returns what the base step returns, and the entries captured (None on another step)."""
        if pending is None:
            return step_fn(optimizer, *args, **kwargs), None
        made, args, kwargs = self._before(pending, args, kwargs, groups)
        with self.capture.view.stepping():  # a view that measures each parameter in its turn of the step
            out = step_fn(optimizer, *args, **kwargs)
        self._after(pending, made)
        return out, made

    def end(self, pending: Pending | None, stepped: bool = True, source: Stepped | None = None,
            local_groups: bool = False, params: Callable[[], list[torch.Tensor]] = list) -> None:
        """End the step that ``pending`` began: count it (a step that stepped nothing as skipped) and, on a
        logging step, reduce, compute the figures and deliver them.

        ``source``: the optimizer whose param groups carry every learning rate (None: the one stepped);
        ``local_groups``: the capture read param groups of a layout's own, whose learning rates are figures too;
        ``params``: the model's parameters stepped, which each watched model's are checked against (asked
        only where a model is watched).
        """
        if not stepped:
            self.skipped()
        elif pending is None:
            self._count.took()
        else:
            self._finish(pending, pending.optimizer if source is None else source, local_groups)
            watched = self.models.watched()
            stepped_params = params() if watched else []
            for model in watched:
                self.health.check_watched(model, stepped_params)

    @stage()
    def _before(self, pending: Pending, args: tuple[Any, ...], kwargs: dict[str, Any],
                groups: set[int] | None = None) -> tuple[Entries, tuple[Any, ...], dict[str, Any]]:
        """Stage 2: the capture before a base step (of the param groups ``groups``, None: all); returns
        the entries it made and the step's arguments, a closure wrapped to record the grads it makes."""
        sharding = pending.sharding
        tell_unmapped(pending.read, self.told)  # DeepSpeed's layout names each fragment: never told there
        grad_scale = getattr(pending.optimizer, "grad_scale", None)
        fuse = self.capture.may_fuse(sharding.sharded, grad_scale, closure_of(args, kwargs, self.closure_first))
        entries = self.capture.before(pending.read, pending.batch, grad_scale,
                                      self.models.names, split=not sharding.sharded, fuse=fuse,
                                      cloned=sharding.cloned(self.capture.view), groups=groups)
        pending.entries.extend(entries)
        return (entries, *with_grads_of_closure(entries.all, pending.batch, args, kwargs, self.closure_first,
                                                self.capture.eager.grads))

    @stage()
    def _after(self, pending: Pending, entries: Entries) -> None:
        """Stage 4: the capture after a base step, of the ``entries`` taken before it."""
        self.capture.after(pending.read.state, entries, pending.batch)

    @stage(last=True)
    def _finish(self, pending: Pending, source: Stepped, local_groups: bool) -> None:
        """Stages 5 to 7: count the step, reduce, compute the figures, deliver."""
        step = self._count.took()
        sharding, entries = pending.sharding, pending.entries
        self.capture.finish(entries)
        roster = self.capture.roster(entries, sharding.shape)
        hosted, reduced, read = reduce.gather(entries, roster, pending.batch.finish(), source, sharding,
                                              self._keys, self._ranks, self.spent.so_far())
        lrs = group_lrs(source.param_groups, read)
        groups = pending.read.param_groups
        everyone = roster.joined(reduced.remote, reduced.names)
        local = group_lrs(groups) if local_groups else None
        figures = self._figures.compute(step, everyone, hosted, source, lrs, groups, local)
        self.capture.remember(roster, hosted if everyone is roster else hosted.head(len(roster.names)))
        figures.update(self.spent.figures(self.settings.figures, reduced.cost))
        if self.guard is not None:
            figures["guard/skipped"] = float(self.guard.skipped)
        self._count.logged_now()
        self._delivery.send(step, figures, everyone, histograms.of(everyone.names, hosted.pieces))


class Pending:
    """A logging step in progress: the optimizer stepped, its layout (:class:`~monitored_optim.distributed.Sharding`,
    or :class:`~monitored_optim.distributed.Unsharded` outside torch.distributed), its batch of sums and
    the entries captured so far."""

    __slots__ = ("optimizer", "sharding", "batch", "entries")

    def __init__(self, optimizer: torch.optim.Optimizer, sharding: distributed.Sharding | distributed.Unsharded,
                 batch: stats.Batch) -> None:
        self.optimizer, self.sharding, self.batch, self.entries = optimizer, sharding, batch, Entries()

    @property
    def read(self) -> Stepped:
        """The optimizer whose param groups and state the capture reads (the sharding's ``local`` one)."""
        return self.sharding.local

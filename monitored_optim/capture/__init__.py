"""The capture: each monitored parameter's p_before and stored change u around the base step.

A logging step runs :meth:`Capture.before`, the base step, then :meth:`Capture.after`. The
:class:`~monitored_optim.capture.plan.Plan` decides each parameter's route once per set of
parameters; the routes run in :mod:`~monitored_optim.capture.eager` and
:mod:`~monitored_optim.capture.fused`; the snapshot rule is :mod:`~monitored_optim.capture.rules`,
the inversion of the store :mod:`~monitored_optim.capture.change`. What comes out is one
:class:`~monitored_optim.stats.Batch` of sums (p_before, grad, u per parameter) and each
parameter's device pieces (:mod:`monitored_optim.pieces`).

Words used throughout:

* *entry*: one parameter, or one *part* (a flat slice) of a large one, on a logging step;
* *route*: how a parameter's p_before and u are taken (:mod:`~monitored_optim.capture.route`);
* *snapshot*: an exact copy of p_before; *inversion*: p_before recovered from p_after and the
  view's update, the store's rounding undone;
* *view*: the object that rebuilds an optimizer's update from its state (:mod:`monitored_optim.updates`);
* *flat chunk*: small parameters laid end to end and measured together;
* *kind*: one of the three tensors measured per parameter, p_before, grad and u (``stats.KINDS``);
* *piece*: a per-parameter device value besides the moments, keyed, with a declared reduction
  (:mod:`monitored_optim.pieces`);
* *shard*: the part of a parameter one rank holds under ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import stats
from ..config import Settings, every_parameter
from ..families.base import Family
from ..hosted import Hosted
from ..updates import View, elementwise, raw_step
from .eager import Eager, chunks, record_grads
from .fused import Fused, dense_grad
from .plan import (Entries, Entry, FlatRun, Plan, Roster, Stepped, assign_slots, build, composition, fingerprint,
                   frozen, names)
from .route import CLONED, FUSED_COPY, FUSED_REBUILD, SKIPPED
from .rules import CentringMemory, RiskMemory
from .spent import Spent, taken as taken_label
from .change import PART_ELEMENTS, Part, parts


class Capture:
    """Takes each monitored parameter's p_before before the base step and its stored change after it.

    Args:
        view: the update view of the optimizer's class (:func:`~monitored_optim.updates.view_for`).
        settings: the monitor's settings (``verify``, ``compile``, ``figures``, ``select``).
        families: the figure families whose ``part`` hook sees each stored change.
        reductions: key head -> reduction of every device piece.
    """

    def __init__(self, view: View, settings: Settings, families: list[Family], reductions: dict[str, str]) -> None:
        self.view, self.settings = view, settings
        self.risk = RiskMemory()
        self.centring = CentringMemory()
        self.eager = Eager(view, settings.verify, families, reductions, self.centring)
        self.fused = Fused(view, settings.compile, self.eager.binned)
        self.budget = PART_ELEMENTS * 4
        self.plan: Plan | None = None
        self.fused_last: bool | None = None  # whether the last logging step might fuse (None: none yet)
        self._roster: Roster | None = None
        self.spent = Spent()  # the logging step's costs and routes taken (describe() reads the last)

    def use(self, view: View) -> None:
        """Capture with ``view`` from now on (the view bound to the optimizer,
        :meth:`~monitored_optim.updates.View.bound`)."""
        self.view = self.eager.view = self.fused.view = view

    def plan_of(self, optimizer: Stepped, known: dict[int, str], fuse: bool,
                cloned: frozenset[int] = frozenset(), split: bool = True) -> Plan:
        """This logging step's :class:`~monitored_optim.capture.plan.Plan`: the last one where its
        fingerprint and the selection (a ``MonitorConfig(params=...)`` callable is asked again at
        every logging step) are the same, else a new one.

        Args:
            optimizer: the optimizer, or under ``torch.distributed`` its local view.
            known: id -> name of the parameters of watched models.
            fuse: whether the fused routes may be taken on this step.
            cloned: ids of the parameters to clone (shards that the view cannot rebuild).
            split: whether large parameters may be cut into slices.
        """
        ways = tuple(self.fused.way(group) if fuse else None for group in optimizer.param_groups)
        key = fingerprint(optimizer, (ways, cloned, len(known), split, elementwise(self.view)))
        kept = self.plan if self.plan is not None and self.plan.key == key else None
        named = kept.names if kept is not None else names(optimizer, known)
        mask = self._mask(optimizer, named)
        if kept is not None and kept.mask == mask:
            return kept
        self.plan = build(optimizer, key, named, mask, ways, self.fused, self.view, cloned, split)
        self.centring.forget(e.name for chunk in self.plan.chunks for e in chunk.members)  # exact for any spread
        return self.plan

    def preview(self, optimizer: Stepped, known: dict[int, str]) -> Plan:
        """The plan of the next logging step, for ``describe()``, not kept: one that may fuse as the
        last one might (a closure, a GradScaler's scale or sharding keeps it off the fused routes), or
        before any, a plain one's (no closure, no scale, one process)."""
        named = names(optimizer, known)
        fuse = self.may_fuse(False, None, None) if self.fused_last is None else self.fused_last
        ways = tuple(self.fused.way(group) if fuse else None for group in optimizer.param_groups)
        return build(optimizer, [], named, self._mask(optimizer, named), ways, self.fused, self.view)

    def _mask(self, optimizer: Stepped, named: list[list[str]]) -> list[bool] | None:
        """Per parameter, whether the selection chooses it; None where it chooses every parameter.

        A ``MonitorConfig(params=...)`` callable is asked again each time."""
        select = self.settings.select
        if select is every_parameter:
            return None
        return [select(n, p) for group, own in zip(optimizer.param_groups, named) for n, p in zip(own, group["params"])]

    @torch.no_grad()
    def before(self, optimizer: Stepped, batch: stats.Batch, grad_scale: Tensor | None,
               known: dict[int, str], split: bool = True, fuse: bool = False,
               cloned: frozenset[int] = frozenset(), groups: set[int] | None = None) -> Entries:
        """Before the base step: an entry per part of each monitored parameter, its p_before as its
        route takes it, and the sums of p_before and the grads in ``batch``.

        Args:
            optimizer, known, fuse, cloned: see :meth:`plan_of`.
            batch: the logging step's sums.
            grad_scale: a fused GradScaler step's scale (the grads are unscaled by it), or None.
            split: whether large parameters may be cut into parts.
            groups: the indices of the param groups that this call of the base step steps (an engine
                that steps its groups one call at a time); None: all of them.
        """
        plan = self.plan_of(optimizer, known, fuse, cloned, split)
        self.fused_last = fuse
        routes, view = self.spent.record(batch).routes, type(self.view).__name__
        self.eager.tally.open(batch)
        self.eager.shared = plan.shared
        entries, unflat, copies = [], [], []
        blocks: list[FlatRun | Entry] = []  # runs of flat entries, and the first part of each other
        assert batch.work is not None  # a logging step's batch has its workspace
        self.budget = batch.work.nbytes = plan.budget  # the batch's buffers: one chunk's temporaries
        for i, (group, items) in enumerate(plan.groups):
            if groups is not None and i not in groups:
                continue
            for item in items:
                if isinstance(item, FlatRun):  # copied into their chunks' buffers, no part
                    routes.update((e.name, item.route.label(view)) for e in item.entries)
                    entries += item.entries
                    blocks.append(item)
                    continue
                p = item.p
                taken = item.route(self.risky(item.name), dense_grad(p))
                if taken.kind == SKIPPED:
                    continue
                if taken.kind == FUSED_COPY:  # the snapshot rule's copy, taken compiled
                    made = [Entry(item.name, group, p, None, fused=True)]
                    copies += made
                elif taken.kind == FUSED_REBUILD:  # the view's fused form, its sums after the step
                    made = [self.eager.entry(item.name, group, Part(p, optimizer.state.get(p, {}), p), None, None,
                                             True)]
                else:
                    reason = "clone" if taken.kind == CLONED else taken.reason
                    made, lead = [], None
                    for part in parts(p, optimizer.state.get(p, {}), taken.slices > 1, self.budget // p.element_size()):
                        made.append(self.eager.entry(item.name, group, part, reason, lead, work=batch.work))
                        lead = lead or made[-1]
                    taken = taken._replace(slices=len(made))  # as cut: a sparse or scattered grad is not
                routes[item.name] = taken_label(taken, view, [e.snapshot for e in made])
                entries += made
                unflat += made
                blocks.append(made[0])
        leads = [e for block in blocks for e in (block.entries if isinstance(block, FlatRun) else [block])]
        assign_slots(blocks, batch.slots(len(stats.KINDS) * len(leads)).start)
        befores = self.fused.before(plan.chunks, copies, [e for e in unflat if e.fused], batch)
        self.spent.copied([*befores, *(x for e in unflat for x in (e.before, e.clone))])
        self.eager.before(batch, [e for e in unflat if not e.fused], grad_scale,
                          grads=bool(self.settings.figures & {"grad_to_data", "norms", "health", "histograms"}))
        return Entries(entries, leads, unflat, befores)

    @torch.no_grad()
    def after(self, state: Any, entries: Entries, batch: stats.Batch) -> None:
        """After the base step: the stored change of every entry and its sums into ``batch``
        (``state``: the optimizer's state)."""
        for chunk in chunks([e for e in entries.unflat if not e.fused], self.budget):
            self.eager.after(chunk, [_part(e).refresh(state.get(_part(e).whole, {})) for e in chunk], batch)
        assert self.plan is not None  # planned by before()
        self.fused.after([e for e in entries.unflat if e.fused], self.plan.chunks, entries.befores, state, batch)

    def finish(self, entries: Entries) -> None:
        """After the last base step of a logging step: the histograms of the parts counted, and the
        families' pieces that need all of a parameter's parts."""
        for owner, values in self.eager.tally.pieces():
            owner.pieces.update(values)
        for fam in self.eager.families:
            done = fam.done()
            by_name = {e.name: e for e in entries.leads} if done else {}
            for name, made in done.items():
                for key, value in made.items():
                    self.eager.add_piece(by_name[name], key, value)

    def may_fuse(self, sharded: bool, grad_scale: Tensor | None, closure: Callable[[], Any] | None) -> bool:
        """Whether a logging step may take the fused routes: one process, no fused GradScaler's scale,
        no verify mode, no closure, and no figure family with a ``part`` hook (the histograms bin the
        flat chunks; the other fused routes are not taken with them, :meth:`Fused.form
        <monitored_optim.capture.fused.Fused.form>`)."""
        return not (sharded or grad_scale is not None or self.settings.verify or closure is not None
                    or self.eager.reads_parts)

    def silent(self, group: dict[str, Any]) -> bool:
        """Whether the step just taken left ``group`` unchanged by the optimizer's design
        (:meth:`~monitored_optim.updates.View.silent` of the view in use)."""
        return self.view.silent(group)

    def risky(self, name: str) -> bool:
        """Whether the snapshot rule's rounding risk copies parameter ``name`` (never where the view
        measures its stored change itself, :attr:`~monitored_optim.updates.View.checks_store`)."""
        return name in self.risk and not self.view.checks_store

    def roster(self, entries: Entries, shape: Callable[[Tensor], torch.Size] | None = None) -> Roster:
        """This logging step's :class:`~monitored_optim.capture.plan.Roster`: the last one where its plan
        and the composition of its entries not captured flat are the same (with the parameters frozen
        now), else a new one (``shape``: see :meth:`~monitored_optim.capture.plan.Roster.of`)."""
        kept, order = self._roster, composition(entries.unflat)
        if kept is None or kept.plan is not self.plan or kept.composition != order:
            assert self.plan is not None  # planned by before()
            kept = self._roster = Roster.of(self.plan, order, entries.leads, shape)
        now = frozen(entries.leads)
        if now != kept.frozen:  # requires_grad changed since (a layer frozen or unfrozen in training)
            kept = self._roster = dataclasses.replace(kept, frozen=now)
        return kept

    def remember(self, roster: Roster, hosted: Hosted) -> None:
        """After a logging step: the centring and snapshot rules' memories for the next one."""
        table, named = hosted.table, roster.names
        self.centring.update(named, roster.captured, table)  # a flat entry has no decision
        exact = torch.full((len(named),), math.nan, dtype=torch.float64)
        measured = [i for i in roster.captured if "exact" in hosted.pieces[i]]  # a flat entry has no pieces
        exact[measured] = torch.tensor([hosted.pieces[i]["exact"][0] for i in measured], dtype=torch.float64)
        self.risk.update(named, roster.position, roster.eps, table, exact)

    def release(self) -> None:
        """Let go of the parameters the plan holds."""
        self.plan = self._roster = None


def closure_runs_ahead(optimizer_cls: type) -> bool:
    """Whether the base ``step`` is torch's own, which calls its closure before anything else (so the
    closure may be run ahead of the step without changing what the step does)."""
    return (getattr(raw_step(optimizer_cls), "__module__", None) or "").startswith("torch.optim")


def closure_is_first(optimizer_cls: type) -> bool:
    """Whether the base ``step``'s first argument after ``self`` is called ``closure``."""
    try:
        params = list(inspect.signature(raw_step(optimizer_cls)).parameters)
    except (TypeError, ValueError):
        return False
    return params[1:2] == ["closure"]


def closure_of(args: tuple[Any, ...], kwargs: dict[str, Any], closure_first: bool) -> Callable[[], Any] | None:
    """The closure a ``step()`` call passes, if any."""
    closure = kwargs["closure"] if "closure" in kwargs else (args[0] if args and closure_first else None)
    return closure if callable(closure) else None


def with_grads_of_closure(entries: list[Entry], batch: stats.Batch, args: tuple[Any, ...], kwargs: dict[str, Any],
                          closure_first: bool, record: Callable[..., None] = record_grads
                          ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``step()`` arguments with the closure wrapped so that the grad sums are those its first call
    makes (``record(batch, entries, None)``: :meth:`~monitored_optim.capture.eager.Eager.grads`).

    A closure-driven step (``SGD.step(closure)``, ``LBFGS``) computes the gradient inside
    ``step()``; what ``p.grad`` held before is stale or ``None``.
    """
    closure = closure_of(args, kwargs, closure_first)
    if closure is None:
        return args, kwargs
    done = False

    def wrapped():
        nonlocal done
        loss = closure()
        if not done:
            done = True
            for e in entries:  # the parts of a large parameter were cut from the grad before the closure
                if e.part is not None:
                    e.part.regrad()
            with torch.no_grad():
                record(batch, entries, None)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": wrapped}
    return (wrapped, *args[1:]), kwargs


__all__ = ["Capture", "closure_is_first", "closure_of", "closure_runs_ahead", "with_grads_of_closure"]


def _part(e: Entry) -> Part:
    """The part that an entry not captured flat is made from."""
    assert e.part is not None  # every eager entry is made from its part (Eager.entry)
    return e.part

"""The figures of a logging step, from its host values: per parameter, global, lr, health, families.

:class:`Figures` turns the step's :class:`~monitored_optim.hosted.Hosted` values (one row per
parameter, :class:`~monitored_optim.capture.plan.Roster` order) into the flat ``{tag: value}``
dict that the backends get. Every value it sends is finite; a figure that is undefined (a ratio of
a zero spread) is left out. Tags are those of :mod:`monitored_optim.tags`.
"""

from __future__ import annotations

import functools
import math
from itertools import compress
from typing import Any, Callable

import torch

from . import families
from .hosted import Hosted, MomentTable
from ._warnings import Once
from .capture.plan import Roster, Stepped
from .config import Settings
from .families.base import Family
from .health import Checks, Health
from .tags import DEFAULT_FAMILIES, family

VERIFY_RTOL = 1e-3
"""Verify mode's tolerance, relative to the update itself: ``||excess|| <= VERIFY_RTOL * ||u_clone||``
(:func:`~monitored_optim.capture.change.verify_miss`)."""


class Figures:
    """Computes a logging step's figures; keeps what they need across steps (health, families).

    Args:
        settings: the monitor's settings (``figures``, ``verify``).
        chosen: the figure families' instances (:func:`monitored_optim.families.build`).
        health: the monitor's health tracker.
        silent: whether the step just taken left a param group unchanged by the optimizer's design
            (:meth:`~monitored_optim.updates.View.silent`); default: never.
    """

    def __init__(self, settings: Settings, chosen: list[Family], health: Health,
                 silent: Callable[[dict[str, Any]], bool] = lambda group: False) -> None:
        self.settings, self.families, self.health, self.silent = settings, chosen, health, silent
        self._verify_told = Once()
        self._tag_names: tuple[str, ...] = ()  # the names of _tag_list: every _tags of each, in order
        self._tag_list: list[str] = []

    def compute(self, step: int, roster: Roster, hosted: Hosted, optimizer: Stepped,
                lrs: list[float | None], groups: list[dict[str, Any]],
                group_lrs: list[float | None] | None = None) -> dict[str, float]:
        """Every figure of the logging step ``step``.

        Args:
            step: the optimizer step (int >= 1).
            roster: the step's parameters; ``hosted``: their host values.
            optimizer: the optimizer; ``lrs``: each of its param groups' learning rate as a float
                (None where it has none, :func:`group_lrs`).
            groups: the param groups the parameters' entries belong to, in ``lrs``' order (under
                ``torch.distributed``, the local view's).
            group_lrs: each of ``groups``' learning rate, where they are not the optimizer's own
                groups one for one (DeepSpeed's sub-groups); None: ``lrs``.
        """
        table = hosted.table
        still = {id(group) for group in groups if self.silent(group)}
        silent = [g in still for g in roster.groups] if still else None  # unchanged by the optimizer's design
        figures = self._per_parameter(roster, hosted, silent)
        rest = {f"global/{kind}_norm": math.sqrt(v)
                for kind, v in zip(("param", "grad", "update"), table.sq_norm.sum(0).tolist())}
        rest.update(learning_rates(optimizer, lrs))
        if "health" in self.settings.figures:  # its counts and warnings need the grads it reduces
            rest.update(self.health.figures(_health_checks(roster.names, table, silent, roster.frozen), step))
        if self.families:
            group_lr = {id(group): lr for group, lr in zip(groups, lrs if group_lrs is None else group_lrs)}
            seen = families.Step(step, roster.names, table, hosted.pieces, list(map(group_lr.get, roster.groups)),
                                 roster.shapes)
            for fam in self.families:
                rest.update(fam.figures(seen))
        figures.update((tag, value) for tag, value in rest.items() if math.isfinite(value))
        chosen = self.settings.figures
        if not chosen.issuperset(DEFAULT_FAMILIES):  # the others (state, spectral) only compute when chosen
            figures = {tag: value for tag, value in figures.items() if family(tag) in chosen}
        if self.settings.verify:
            errors = [self._verify_error(name, *got["verify"])
                      for name, got in zip(roster.names, hosted.pieces) if "verify" in got]
            if errors and math.isfinite(max(errors)):
                figures["verify/max_rel_error"] = max(errors)
        return figures

    def _per_parameter(self, roster: Roster, hosted: Hosted, silent: list[bool] | None) -> dict[str, float]:
        """The five of :func:`_tags` (the grad's only where there was one, none undefined or not
        finite) and ``update_lost`` in low precision (0 where ``silent``: nothing was meant to move)."""
        table, norm, names = hosted.table, hosted.table.norm, roster.names
        columns = torch.stack([norm[:, 0], norm[:, 2], table.log10_ratio(2, 0),
                               norm[:, 1], table.log10_ratio(1, 0)], 1)
        shown = columns.isfinite()
        shown[:, 3:] &= table.has[:, 1:2]
        if tuple(names) != self._tag_names:  # the same parameters as the last logging step: the same tags
            self._tag_names, self._tag_list = tuple(names), [tag for name in names for tag in _tags(name)]
        tags = compress(self._tag_list, shown.flatten().tolist())
        figures = dict(zip(tags, columns[shown].tolist()))
        n = table.n[:, 0].tolist()
        for i in roster.low:
            got = hosted.pieces[i]
            if "lost" in got and n[i] > 0:
                figures[f"update_lost/{names[i]}"] = 0.0 if silent and silent[i] else got["lost"][0] / n[i]
        return figures

    def _verify_error(self, name: str, miss: float, truth: float) -> float:
        """Relative error of the view against the clone; warns once per parameter beyond
        :data:`VERIFY_RTOL` of the update itself."""
        if miss > VERIFY_RTOL * truth and self._verify_told.first(name):
            self.health.voice.warn(  # where the figures are written: every rank finds the same miss
                f"monitored_optim verify: the update of {name!r} rebuilt from the optimizer state differs from "
                f"the clone-based truth by {miss:.3g} (norm {truth:.3g}) beyond the rounding of the stored value; "
                "please report it with your torch version and optimizer flags")
        return miss / truth if truth > 0 else (0.0 if miss == 0 else math.inf)


@functools.lru_cache(maxsize=1 << 16)
def _tags(name: str) -> tuple[str, ...]:
    """The per-parameter tags of ``name``, in the order of the columns of ``Figures._per_parameter``."""
    return (f"param_norm/{name}", f"update_norm/{name}", f"update_to_data/{name}",
            f"grad_norm/{name}", f"grad_to_data/{name}")


def _health_checks(names: list[str], table: MomentTable, silent: list[bool] | None = None,
                   frozen: list[bool] | None = None) -> Checks:
    """The :class:`~monitored_optim.health.Checks` of a logging step from its table: a grad where the
    table has one, unchanged where it had a grad and its update is all zeros (unless ``silent``, per
    parameter: by the optimizer's design), non-finite values, grads (where it had one) and updates,
    the ratios withheld for sums too coarse to tell their spread, and ``frozen`` (per parameter:
    frozen on purpose; None: none is)."""
    has_grad = table.has[:, 1]
    unchanged = has_grad & table.all_zero[:, 2] & (table.n[:, 0] > 0)
    if silent is not None:
        unchanged &= ~torch.tensor(silent, dtype=torch.bool)
    nonfinite = {}
    if not table.finite.all().tolist():  # the usual case has nothing to name (tolist: no scalar read)
        bad = ~table.finite  # a kind without values holds zeros: finite
        rows = bad.any(1)
        nonfinite = {names[i]: tuple(label for label, hit in zip(("value", "grad", "update"), row) if hit)
                     for i, row in zip(rows.nonzero().flatten().tolist(), bad[rows].tolist())}
    coarse = table.coarse
    withheld = torch.stack([coarse[:, 2] | coarse[:, 0], has_grad & (coarse[:, 1] | coarse[:, 0])])
    return Checks(names, has_grad.tolist(), unchanged.tolist(), nonfinite, sum(withheld.flatten().tolist()),
                  frozen or ())


def group_lrs(groups: list[dict[str, Any]], read: dict[int, list[float]] | None = None) -> list[float | None]:
    """Each param group's lr as a float: a number as it is, a Tensor lr from ``read`` (its
    :func:`~monitored_optim.reduce.tensor_lrs` value on the host), None otherwise (``lr=None``, or a
    Tensor not read)."""
    read = read or {}
    return [read[i][0] if i in read else float(group["lr"]) if isinstance(group.get("lr"), (int, float)) else None
            for i, group in enumerate(groups)]


def learning_rates(optimizer: Stepped, lrs: list[float | None]) -> dict[str, float]:
    """``lr/group{i}`` (or ``lr/{name}``) per param group, from its :func:`group_lrs` ``lrs``."""
    return {f"lr/{_group_label(i, group)}": lr for i, (group, lr) in enumerate(zip(optimizer.param_groups, lrs))
            if lr is not None}


def _group_label(i: int, group: dict[str, Any]) -> str:
    """A param group's ``name`` where it is a string, else ``group{i}``."""
    return group["name"] if isinstance(group.get("name"), str) else f"group{i}"

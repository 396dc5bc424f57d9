"""Health of each parameter at a logging step: no grad, unchanged, non-finite; skipped AMP steps.

Counts go to the backends as ``health/no_grad``, ``health/unchanged``, ``health/nonfinite``,
``health/skipped_steps`` and ``health/withheld``; each condition is also told once per parameter with ``warnings.warn``,
naming the parameter, so that it reaches a user who never opens TensorBoard: one warning per
condition and logging step, naming the first parameter and up to five more (a model whose
thousand layers stop changing at once gets one warning, not a thousand).
"""

from __future__ import annotations

import collections
from itertools import compress
from collections.abc import Sequence
from typing import Callable, NamedTuple

import torch

from ._warnings import Once, warn
from .alerts import Voice
from .models import own_named_parameters

STALE_AFTER = 3
"""Consecutive logging steps a parameter with a gradient may stay exactly unchanged (or a parameter
may have no gradient) before a warning.

Three logging steps tell a parameter cut off from the loss by mistake, or one lost to rounding, from
a single step that happened to leave it alone (Rprop's suppressed steps, a zero gradient row)."""


class Checks(NamedTuple):
    """What one logging step saw of the monitored parameters, one element per parameter in order.

    Attributes:
        names: the parameters' names.
        has_grad: ``p.grad`` was not ``None`` for the step.
        unchanged: it had a grad, yet its update is exactly zero in every element.
        nonfinite: name -> which of ``"value"``, ``"grad"``, ``"update"`` hold a NaN or Inf, for
            the parameters where some do.
        withheld: how many ratios (``update_to_data``, ``grad_to_data``) were not sent because
            their one-pass sums could not tell a spread tiny next to the mean (sent again from the
            next logging step, which centres them).
        frozen: frozen on purpose (an ``nn.Parameter`` with ``requires_grad=False``): no grad, or no
            change, by design: counted but not warned about; empty: none is.
    """

    names: list[str]
    has_grad: list[bool]
    unchanged: list[bool]
    nonfinite: dict[str, tuple[str, ...]]
    withheld: int = 0
    frozen: Sequence[bool] = ()


class Health:
    """Counts per logging step, cumulative skipped steps, and warnings that name each parameter once.

    Args:
        voice: the run's :class:`~monitored_optim.alerts.Voice`, which warns in the process that writes
            the figures and hears the events ``nonfinite``, ``unchanged`` and ``no_grad``; default: one
            that warns in this process.

    Attributes:
        skipped_steps: optimizer steps skipped by AMP loss scaling so far (int).
    """

    def __init__(self, voice: Voice | None = None) -> None:
        self.skipped_steps = 0
        self.voice = voice if voice is not None else Voice()
        self._unchanged_streak: dict[str, int] = {}
        self._no_grad_streak: dict[str, int] = {}
        self._told: dict[str, Once] = collections.defaultdict(Once)  # kind -> the names told of

    def figures(self, checks: Checks, step: int) -> dict[str, float]:
        """The ``health/*`` counts for this logging step (floats), warning about new conditions.

        Args:
            checks: the step's :class:`Checks`.
            step: the optimizer step (for the messages).
        """
        self._warn_nonfinite(checks.nonfinite, step)
        self._warn_unchanged(checks, step)
        self._warn_no_grad(checks, step)
        return {
            "health/no_grad": float(len(checks.has_grad) - sum(checks.has_grad)),
            "health/unchanged": float(sum(checks.unchanged)),
            "health/nonfinite": float(len(checks.nonfinite)),
            "health/skipped_steps": float(self.skipped_steps),
            "health/withheld": float(checks.withheld),
        }

    def check_watched(self, model: torch.nn.Module, params: list[torch.Tensor]) -> list[str]:
        """Warn once about each trainable parameter of ``model`` that is not in ``params`` (those the
        optimizer steps).

        Returns the names (as the plain model inside ``model``'s wrappers gives them) of the missing
        parameters.
        """
        given = {id(p) for p in params}
        if all(id(p) in given for p in model.parameters() if p.requires_grad):
            return []
        missing = [n for n, p in own_named_parameters(model) if p.requires_grad and id(p) not in given]
        self._once("missing", missing, lambda name: (
            f"monitored_optim: trainable parameter {name!r} of the watched model is in no param group of the "
            "optimizer, so it never changes; add it to the optimizer or set requires_grad=False"))
        return missing

    def _warn_nonfinite(self, bad: dict[str, tuple[str, ...]], step: int) -> None:
        if not bad:
            return
        self.voice.event("nonfinite", step, [f"{name} ({' and '.join(parts)})" for name, parts in bad.items()])
        order = "also" if self._told["nonfinite"] else "first"
        self._once("nonfinite", list(bad), lambda name: (
            f"monitored_optim: parameter {name!r} has NaN or Inf in its {' and '.join(bad[name])} at step {step} "
            f"({order} non-finite parameter); look for a too-high learning rate, a division by zero or an "
            "overflow in low precision"))

    def _warn_unchanged(self, checks: Checks, step: int) -> None:
        self._warn_streak("unchanged", step, checks.names, _unless_frozen(checks.unchanged, checks),
                          self._unchanged_streak, lambda name, n: (
            f"monitored_optim: parameter {name!r} has a gradient but has not changed for {n} logging steps "
            f"(step {step}): a zero gradient (dead ReLU), a zero learning rate, or updates lost to bf16/fp16 "
            "rounding"))

    def _warn_no_grad(self, checks: Checks, step: int) -> None:
        self._warn_streak("no_grad", step, checks.names, _unless_frozen([not g for g in checks.has_grad], checks),
                          self._no_grad_streak,
                          lambda name, n: (
            f"monitored_optim: parameter {name!r} has had no gradient for {n} logging steps (step {step}): "
            "a layer that forward never uses, or one cut off from the loss (detach, no_grad); connect it or leave "
            "it out of the optimizer"))

    def _warn_streak(self, kind: str, step: int, names: list[str], now: list[bool], streaks: dict[str, int],
                     message: Callable[[str, int], str]) -> None:
        """Count each parameter's run of logging steps in condition ``kind`` (``now``, per name of
        ``names``); for those whose run reached :data:`STALE_AFTER`, tell the event ``kind`` at
        ``step`` and warn about the new ones (``message(first name, its run)``). A name not in
        ``names`` keeps its run."""
        flagged = list(compress(names, now))
        still = set(flagged)
        ended = [n for n in streaks if n not in still]
        if ended:  # runs end where the condition no longer holds
            monitored = set(names)
            for name in ended:
                if name in monitored:
                    del streaks[name]
        stale = []
        for name in flagged:
            run = streaks[name] = streaks.get(name, 0) + 1
            if run >= STALE_AFTER:
                stale.append(name)
        if stale:
            self.voice.event(kind, step, [f"{name} ({streaks[name]} logging steps)" for name in stale])
            self._once(kind, stale, lambda name: message(name, streaks[name]))

    def _once(self, kind: str, names: list[str], message: Callable[[str], str]) -> None:
        """Warn ``message(name)`` for the first of ``names`` not yet told of ``kind``: one warning for
        all those it is new for, naming up to five more of them; in the process that writes the
        figures alone (under ``torch.distributed`` every rank checks the same figures)."""
        fresh = self._told[kind].new(names)
        if not fresh or not self.voice.tells():
            return
        text, more = message(fresh[0]), fresh[1:]
        if more:
            shown = ", ".join(repr(n) for n in more[:5]) + (f" and {len(more) - 5} more" if len(more) > 5 else "")
            text += f" (the same for {len(more)} more parameter{'s' if len(more) > 1 else ''}: {shown})"
        warn(text, RuntimeWarning)


def _unless_frozen(flags: list[bool], checks: Checks) -> list[bool]:
    """``flags`` (per parameter of ``checks``) less the parameters frozen on purpose: with no grad or
    no change by design, they are counted but not warned about."""
    if not checks.frozen:
        return flags
    return [flag and not frozen for flag, frozen in zip(flags, checks.frozen)]

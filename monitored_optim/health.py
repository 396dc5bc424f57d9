"""Health of each parameter at a logging step: no grad, unchanged, non-finite; skipped AMP steps.

Counts go to the backends as ``health/no_grad``, ``health/unchanged``, ``health/nonfinite`` and
``health/skipped_steps``; each condition is also told once per parameter with ``warnings.warn``,
naming the parameter, so that it reaches a user who never opens TensorBoard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._warnings import warn

STALE_AFTER = 3
"""Consecutive logging steps a parameter with a gradient may stay exactly unchanged (or a parameter
may have no gradient) before a warning.

Three logging steps tell a frozen-by-mistake or lost-to-rounding parameter from a single step that
happened to leave it alone (Rprop's suppressed steps, a zero gradient row)."""


@dataclass(frozen=True)
class ParamHealth:
    """What one logging step saw of one parameter.

    Attributes:
        name: the parameter's name.
        has_grad: ``p.grad`` was not ``None`` for the step.
        unchanged: it had a grad, yet its update is exactly zero in every element.
        nonfinite: which of ``"value"``, ``"grad"``, ``"update"`` hold a NaN or Inf (empty if none).
    """

    name: str
    has_grad: bool
    unchanged: bool
    nonfinite: tuple[str, ...]


class Health:
    """Counts per logging step, cumulative skipped steps, and once-per-parameter warnings.

    Attributes:
        skipped_steps: optimizer steps skipped by AMP loss scaling so far (int).
    """

    def __init__(self) -> None:
        self.skipped_steps = 0
        self._unchanged_streak: dict[str, int] = {}
        self._no_grad_streak: dict[str, int] = {}
        self._told: set[tuple[str, str]] = set()

    def figures(self, params: list[ParamHealth], step: int) -> dict[str, float]:
        """The ``health/*`` counts for this logging step (floats), warning about new conditions.

        Args:
            params: one record per monitored parameter, in parameter order.
            step: the optimizer step (for the messages).
        """
        self._warn_nonfinite(params, step)
        self._warn_unchanged(params, step)
        self._warn_no_grad(params, step)
        return {
            "health/no_grad": float(sum(not p.has_grad for p in params)),
            "health/unchanged": float(sum(p.unchanged for p in params)),
            "health/nonfinite": float(sum(bool(p.nonfinite) for p in params)),
            "health/skipped_steps": float(self.skipped_steps),
        }

    def check_watched(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """Warn once about each trainable parameter of ``model`` that no param group contains.

        Returns the names (as ``model.named_parameters()`` gives them) of the missing parameters.
        """
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
        for name in missing:
            self._once("missing", name, f"monitored_optim: trainable parameter {name!r} of the watched model "
                       "is in no param group of the optimizer, so it never changes; add it to the optimizer "
                       "or set requires_grad=False")
        return missing

    def _warn_nonfinite(self, params: list[ParamHealth], step: int) -> None:
        fresh = [p for p in params if p.nonfinite and ("nonfinite", p.name) not in self._told]
        for i, p in enumerate(fresh):
            order = "first" if i == 0 and not any(k == "nonfinite" for k, _ in self._told) else "also"
            self._once("nonfinite", p.name, f"monitored_optim: parameter {p.name!r} has NaN or Inf in its "
                       f"{' and '.join(p.nonfinite)} at step {step} ({order} non-finite parameter); look for a "
                       "too-high learning rate, a division by zero or an overflow in low precision")

    def _warn_unchanged(self, params: list[ParamHealth], step: int) -> None:
        for p in params:
            streak = self._unchanged_streak.get(p.name, 0) + 1 if p.unchanged else 0
            self._unchanged_streak[p.name] = streak
            if streak >= STALE_AFTER:
                self._once("unchanged", p.name, f"monitored_optim: parameter {p.name!r} has a gradient but "
                           f"has not changed for {streak} logging steps (step {step}): a zero gradient "
                           "(dead ReLU), a zero learning rate, or updates lost to bf16/fp16 rounding")

    def _warn_no_grad(self, params: list[ParamHealth], step: int) -> None:
        for p in params:
            streak = self._no_grad_streak.get(p.name, 0) + 1 if not p.has_grad else 0
            self._no_grad_streak[p.name] = streak
            if streak >= STALE_AFTER:
                self._once("no_grad", p.name, f"monitored_optim: parameter {p.name!r} has had no gradient for "
                           f"{streak} logging steps (step {step}): frozen by mistake, or a layer that forward "
                           "never uses; unfreeze it or leave it out of the optimizer")

    def _once(self, kind: str, name: str, message: str) -> None:
        if (kind, name) not in self._told:
            self._told.add((kind, name))
            warn(message, RuntimeWarning)

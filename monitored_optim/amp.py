"""Steps that ``torch.amp.GradScaler`` skips because of inf/NaN gradients.

Unfused optimizers: the scaler decides in ``GradScaler._maybe_opt_step`` and then simply does not
call ``optimizer.step()``. :func:`install` wraps that method once per process so that a monitored
optimizer learns of the skip (it compares its count of base-step calls before and after); the
user's loop and the scaler's arithmetic are unchanged. Fused optimizers: the scaler calls
``step()`` with ``optimizer.grad_scale`` and ``optimizer.found_inf`` set; the monitor reads them
itself (:func:`skips`, :class:`monitored_optim.engine.Alone`). Source: ``torch/amp/grad_scaler.py`` (torch 2.13).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch

_MARK = "_monitored_optim_wrapped"


class Counted(Protocol):
    """What counts a monitored optimizer's base steps (:class:`monitored_optim.engine.Engine`)."""

    base_calls: int

    def skipped(self) -> None: ...


def install(counted: Callable[[torch.optim.Optimizer], Counted | None]) -> None:
    """Wrap ``torch.amp.GradScaler._maybe_opt_step`` (idempotent; a no-op if torch lacks it).

    ``counted``: what counts an optimizer's base steps, None where it is not monitored."""
    scaler_cls = torch.amp.GradScaler
    original = getattr(scaler_cls, "_maybe_opt_step", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _maybe_opt_step(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        counts = counted(optimizer)
        calls = counts.base_calls if counts is not None else 0
        out = original(self, optimizer, *args, **kwargs)
        if counts is not None and counts.base_calls == calls:
            counts.skipped()
        return out

    setattr(_maybe_opt_step, _MARK, True)
    scaler_cls._maybe_opt_step = _maybe_opt_step  # type: ignore[method-assign]  # the patch itself


def skips(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a GradScaler calls this step of a fused optimizer only to skip it (``found_inf`` set)."""
    found_inf = getattr(optimizer, "found_inf", None)
    return found_inf is not None and bool(found_inf)

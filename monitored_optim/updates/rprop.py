"""Rprop view (``torch/optim/rprop.py``, torch 2.13).

torch's Rprop, with ĝ = -grad under ``maximize`` else grad, etas (η-, η+), step-size bounds
[Γmin, Γmax], per-element step size Γ (``step_size``) and previous gradient ``prev``:

    σ = sign(ĝ·prev);   Γ ← clamp(Γ·(η+ if σ > 0, η- if σ < 0, 1 if σ = 0), Γmin, Γmax)
    ĝ ← 0 where σ was negative (the step is suppressed);   p_a = p_b - sign(ĝ)·Γ;   prev ← ĝ

Rebuild after the step from the stored prev and Γ, which are exactly what the step used:

    u = -sign(prev)·Γ   (exact: ±Γ or 0 per element; the zeroed prev is the suppressed-step mask).

lr is only read when Γ is first filled, so later lr changes play no part. ``capturable`` reaches the
same values with ``torch.where``; ``differentiable=True`` falls back to a clone. Source: Riedmiller &
Braun (1993) "A Direct Adaptive Method for Faster Backpropagation Learning: The RPROP Algorithm",
``torch/optim/rprop.py`` (``_single_tensor_rprop``, ``_multi_tensor_rprop``) and
``docs/update-formulas.md`` §Rprop.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._shared import like, real
from .clone import Cloned
from .view import View


class RpropView(View):
    """State-aware view for ``torch.optim.Rprop`` (formula in the module docstring)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        if p.grad is not None and group["differentiable"]:
            return Cloned.of(p)
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | None:
        if p.grad is None or "prev" not in state:
            return None
        return like(real(state["prev"]).sign().mul_(real(state["step_size"])).neg_(), p)

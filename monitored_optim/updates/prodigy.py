"""Prodigy view (prodigyopt 1.1, ``prodigyopt/prodigy.py``, ``Prodigy.step``).

Prodigy (Mishchenko & Defazio, 2024, "Prodigy: An Expeditiously Adaptive Parameter-Free Learner") is
Adam whose step size d is estimated as it goes. With the group's d and k read before the step (d_b,
k_b; the step overwrites both), the d it stores (d_a), lr, betas (β1, β2), eps and weight decay λ:

    bc = sqrt(1 - β2^(k_b+1)) / (1 - β1^(k_b+1))   (1 without ``use_bias_correction``)
    dlr = d_b·lr·bc;   g' = g + λ·p_b (coupled decay: written into ``p.grad``)
    m ← β1·m + d_b(1-β1)·g';   v ← β2·v + d_b²(1-β2)·g'²;   D = sqrt(v) + d_a·eps
    p ← s·p with s = 1 - λ·dlr (decoupled decay);   p ← p - dlr·m / D   (β1 = 0: p - dlr·d_a·g' / D)

Rebuild after the step from the stored m (or ``p.grad``, g'), v, d_a and the snapshot (d_b, k_b),
a few numbers: u = ``Stores((Scaled(m / D, -dlr),), s)`` (s = 1 without decoupled decay), the stores
the capture inverts in turn. A step that returns before moving anything (no gradient mass: d's
denominator is 0) leaves k as it was: u = None. Prodigy takes lr as the largest over all groups
and betas from the first group; a group with lr 0 (moved with another group's lr) and complex
parameters are cloned, and decoupled decay with |s| < 1/2 too.
Source: prodigyopt 1.1.2, ``Prodigy.step``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._shared import KAPPA_MAX
from .clone import Cloned, Scaled, Stores
from .view import View


class ProdigyView(View):
    """State-aware view for prodigyopt's ``Prodigy`` (module docstring)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | tuple[float, int] | None:
        if p.grad is None:
            return None
        d, k = group["d"], group["k"]
        if group["lr"] == 0.0 or p.is_complex() or abs(_decay(group, _dlr(group, d, k))) * KAPPA_MAX < 1.0:
            return Cloned.of(p)
        return d, k

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any],
               snapshot: tuple[float, int] | None) -> Stores | None:
        if p.grad is None or snapshot is None or "exp_avg_sq" not in state or group["k"] == snapshot[1]:
            return None
        d_a, dlr = group["d"], _dlr(group, *snapshot)
        denom = state["exp_avg_sq"].sqrt().add_(d_a * group["eps"])
        if group["betas"][0] > 0:
            d = Scaled(state["exp_avg"].div(denom), -dlr)
        else:
            d = Scaled(p.grad.div(denom), -dlr * d_a)
        return Stores((d,), _decay(group, dlr))

    def keeps_grad(self, group: dict[str, Any]) -> bool:
        """False under coupled weight decay, which the step adds into ``p.grad``."""
        return group["weight_decay"] == 0 or group["decouple"]


def _dlr(group: dict[str, Any], d: float, k: int) -> float:
    """dlr = d·lr·bc of the step that starts at (d, k), in Prodigy's order of operations."""
    beta1, beta2 = group["betas"]
    bc = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1)) if group["use_bias_correction"] else 1
    return d * group["lr"] * bc


def _decay(group: dict[str, Any], dlr: float) -> float:
    """s = 1 - λ·dlr under decoupled decay, else 1."""
    return 1.0 - group["weight_decay"] * dlr if group["weight_decay"] != 0 and group["decouple"] else 1.0

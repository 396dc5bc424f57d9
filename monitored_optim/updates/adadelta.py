"""Adadelta view (``torch/optim/adadelta.py``, torch 2.13).

torch's Adadelta, with ĝ = -grad under ``maximize`` else grad, decay ρ, weight decay λ (L2):

    g' = ĝ + λ·p_b;   s ← ρ·s + (1-ρ)·g'^2   (``square_avg``)
    δ = sqrt(a_old + eps) / sqrt(s + eps) · g';   a ← ρ·a_old + (1-ρ)·δ^2   (``acc_delta``)
    p_a = p_b - lr·δ

a_old is overwritten, but a + ρ·eps = (a_old + eps)(ρ + (1-ρ)·g'^2 / (s + eps)), so from the stored
s and a (sums of positive terms: no cancellation)

    δ = g' · sqrt((a + ρ·eps) / (ρ(s + eps) + (1-ρ)·g'^2)),   u = -lr·δ.

With λ = 0, g' = ĝ and the rebuild is direct. With λ > 0, g' holds p_b through a non-linear
equation per element (g' = ĝ + λ·p_a + λ·lr·δ(g'), solvable by Newton where λ·lr·sqrt(a/(ρs)) < 1);
this view does not solve it: parameters of a group with λ > 0 take the clone, as do
``differentiable=True`` groups. ``capturable`` and a Tensor lr change nothing here (lr enters as a
factor). Source: Zeiler (2012) "ADADELTA: An Adaptive Learning Rate Method", ``torch/optim/adadelta.py``
(``_single_tensor_adadelta``, ``_multi_tensor_adadelta``) and ``docs/update-formulas.md``
§Adadelta.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._shared import like, real, to_scalar
from .clone import Cloned
from .view import View


class AdadeltaView(View):
    """State-aware view for ``torch.optim.Adadelta`` (formulas in the module docstring)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        if p.grad is not None and (group["differentiable"] or group["weight_decay"] != 0):
            return Cloned.of(p)
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | None:
        if p.grad is None or "acc_delta" not in state:
            return None
        g = real(-p.grad if group["maximize"] else p.grad)
        s, a = real(state["square_avg"]), real(state["acc_delta"])
        return like(_delta(g, s, a, group["rho"], group["eps"]).mul_(-to_scalar(group["lr"])), p)


def _delta(g: Tensor, s: Tensor, a: Tensor, rho: float, eps: float) -> Tensor:
    """δ = g·sqrt((a + ρ·eps) / (ρ(s + eps) + (1-ρ)·g^2)) from the post-step s and a (a new tensor)."""
    den = (s + eps).mul_(rho).addcmul_(g, g, value=1 - rho)
    return (a + rho * eps).div_(den).sqrt_().mul_(g)

"""RMSprop view (``torch/optim/rmsprop.py``, torch 2.13).

torch's RMSprop, with ĝ = -grad under ``maximize`` else grad, smoothing α, weight decay λ (L2),
momentum μ:

    g' = ĝ + λ·p_b;   v ← α·v + (1-α)·g'^2   (``square_avg``)
    centered: m ← lerp(m, g', 1-α) (``grad_avg``), D = sqrt(v - m^2) + eps;   else D = sqrt(v) + eps
    μ > 0: b ← μ·b + g'/D (``momentum_buffer``), p_a = p_b - lr·b;   μ = 0: p_a = p_b - lr·g'/D

Rebuild after the step (D is recomputed from the stored v, m exactly as torch computed it):

* μ > 0: u = -lr·b (exact for any λ and centered: the decay lives inside b);
* μ = 0, λ = 0: u = -lr·ĝ / D;
* μ = 0, λ > 0: g' holds p_b, so solve p_a = p_b - lr(ĝ + λ·p_b)/D:  u = -lr(ĝ + λ·p_a) / (D - lr·λ).
  The rounding of p_a is multiplied by κ = D / |D - lr·λ|, unbounded where D ≈ lr·λ. ``before``
  computes D after the step from p_b, the grad and the state (torch's own operations) and takes a
  clone unless max κ ≤ ``KAPPA_MAX``. That check reads one number on the host: done for CPU
  parameters; elsewhere this case always takes the clone.

A Tensor lr and ``capturable`` only change how lr multiplies (same value). ``differentiable=True``
falls back to a clone. Source: Hinton, "Neural Networks for Machine Learning" lecture 6e; Graves (2013)
"Generating Sequences With Recurrent Neural Networks" (centered); ``torch/optim/rmsprop.py``
(``_single_tensor_rmsprop``, ``_multi_tensor_rmsprop``) and ``docs/update-formulas.md``
§RMSprop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._shared import KAPPA_MAX, in_double, like, max_kappa, real, to_scalar
from .clone import Cloned
from .view import View


class RMSpropView(View):
    """State-aware view for ``torch.optim.RMSprop`` (formulas in the module docstring)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        if p.grad is None:
            return None
        if group["differentiable"] or (_solves(group) and not _well_conditioned(group, p, state)):
            return Cloned.of(p)
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | None:
        if p.grad is None or "square_avg" not in state:
            return None
        lr = to_scalar(group["lr"])
        if group["momentum"] > 0:
            return like(real(state["momentum_buffer"]) * -lr, p)
        g = real(-p.grad if group["maximize"] else p.grad)
        denom = _denom(group, real(state["square_avg"]), real(state["grad_avg"]) if group["centered"] else None)
        wd = group["weight_decay"]
        if wd != 0:
            return like((g + wd * real(p.detach())).mul_(-lr).div_(denom.sub_(in_double(lr) * wd)), p)
        return like((g * -lr).div_(denom), p)


def _solves(group: dict[str, Any]) -> bool:
    """Whether the rebuild needs the weight-decay solve (λ > 0 without momentum)."""
    return group["weight_decay"] != 0 and group["momentum"] == 0


def _denom(group: dict[str, Any], square_avg: Tensor, grad_avg: Tensor | None) -> Tensor:
    """D = sqrt(v - m^2) + eps (centered) or sqrt(v) + eps, in torch's operation order (a new tensor)."""
    avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_() if grad_avg is not None else square_avg.sqrt()
    return avg.add_(group["eps"])


def _well_conditioned(group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
    """Whether the λ > 0 solve keeps κ = D / |D - lr·λ| ≤ ``KAPPA_MAX`` on every element.

    D after the step is computed now from p_b, the grad, v and m, with torch's own operations; the
    maximum is read on the host, so parameters off the CPU answer False. Before the first step the
    state is torch's initial one: zeros.
    """
    if p.device.type != "cpu":
        return False
    alpha, wd = group["alpha"], group["weight_decay"]
    grad = p.grad
    assert grad is not None  # asked only of a parameter with a grad
    g = real(-grad if group["maximize"] else grad).add(real(p.detach()), alpha=wd)
    v = _old(state, "square_avg", g).mul(alpha).addcmul_(g, g, value=1 - alpha)
    m = _old(state, "grad_avg", g).lerp(g, 1 - alpha) if group["centered"] else None
    return max_kappa(_denom(group, v, m), float(group["lr"]) * wd) <= KAPPA_MAX


def _old(state: dict[str, Any], key: str, like_: Tensor) -> Tensor:
    """The pre-step state tensor ``key`` (real view), or torch's initial zeros before the first step."""
    return real(state[key]) if key in state else torch.zeros_like(like_)

"""RAdam view (``torch/optim/radam.py``, torch 2.13).

torch's RAdam, with ĝ = -grad under ``maximize`` else grad, step t (already incremented),
bc1 = 1 - β1^t, bc2 = 1 - β2^t, s = 1 - lr·λ:

    L2:  g' = ĝ + λ·p_b;                     decoupled: p ← s·p, g' = ĝ
    m ← lerp(m, g', 1-β1);   v ← β2·v + (1-β2)·g'^2
    ρ∞ = 2/(1-β2) - 1;   ρ_t = ρ∞ - 2t·β2^t / bc2
    ρ_t > 5:  r = sqrt((ρ_t-4)(ρ_t-2)ρ∞ / ((ρ∞-4)(ρ∞-2)ρ_t));   d = -lr·r·sqrt(bc2)/bc1 · m/(sqrt(v) + eps)
    else:     d = -(lr/bc1)·m
    p_a = (s·)p_b + d

Rebuild after the step from the stored m, v and t (the branch is a function of t alone):

* L2 or no weight decay: u = d (the decay lives inside m and v);
* decoupled: ``Stores((d,), s)``, the stores p ← s·p, p ← p + d, inverted in turn by the capture.

Scalar arithmetic mirrors the path torch took: the foreach path folds lr, r, bc1 and sqrt(bc2)
into one coefficient (float32 tensor arithmetic under a Tensor lr), the single-tensor path
multiplies them into the tensor one by one; ``capturable`` computes ρ_t, r and the bias corrections
as float32 tensors (ρ_t is a difference of two numbers near ρ∞, so its rounding, and the branch,
must be reproduced operation for operation). ``differentiable=True`` falls back to a clone.
Source: Liu et al. (2020) "On the Variance of the Adaptive Learning Rate and Beyond",
``torch/optim/radam.py`` (``_single_tensor_radam``, ``_multi_tensor_radam``) and
``docs/update-formulas.md`` §RAdam.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._shared import ran_foreach
from .clone import Cloned, Stores
from .view import View


class RAdamView(View):
    """State-aware view for ``torch.optim.RAdam`` (formulas in the module docstring)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        if group["differentiable"]:
            return Cloned.of(p)
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | Stores | None:
        if p.grad is None or "exp_avg" not in state:
            return None
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if torch.is_complex(p):  # torch steps complex tensors as pairs of reals
            m, v = torch.view_as_real(m), torch.view_as_real(v)
        lr = group["lr"]
        if isinstance(lr, Tensor) and lr.dim() != 0:
            lr = lr.squeeze()
        foreach = ran_foreach(group)
        if group["capturable"]:
            u = (_capturable_foreach if foreach else _capturable_single)(group, lr, state["step"], m, v)
        else:
            u = (_foreach if foreach else _single)(group, lr, state["step"].item(), m, v)
        u = torch.view_as_complex(u) if torch.is_complex(p) else u
        wd = group["weight_decay"]
        return Stores((u,), 1 - lr * wd) if wd != 0 and group["decoupled_weight_decay"] else u


def _rect(rho_t, rho_inf: float):
    return ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5


def _single(group: dict[str, Any], lr: float | Tensor, step: float, m: Tensor, v: Tensor) -> Tensor:
    """d of ``_single_tensor_radam`` with a Python step (a new tensor)."""
    (beta1, beta2), eps = group["betas"], group["eps"]
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2**step) / bc2
    if rho_t > 5.0:
        adaptive = (bc2**0.5) / v.sqrt().add_(eps)
        return (m / bc1).mul_(lr).mul_(adaptive).mul_(_rect(rho_t, rho_inf)).neg_()
    return (m / bc1).mul_(lr).neg_()


def _foreach(group: dict[str, Any], lr: float | Tensor, step: float, m: Tensor, v: Tensor) -> Tensor:
    """d of ``_multi_tensor_radam`` with a Python step: m times one per-tensor coefficient."""
    (beta1, beta2), eps = group["betas"], group["eps"]
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2**step) / (1 - beta2**step)
    bc1 = 1 - beta1**step
    if rho_t > 5:
        coef = ((1 - beta2**step) ** 0.5) * (lr * _rect(rho_t, rho_inf) / bc1) * -1
        return v.sqrt().add_(eps).div_(coef).reciprocal_().mul_(m)
    return m * ((lr * 1.0 / bc1) * -1)


def _capturable_single(group: dict[str, Any], lr: float | Tensor, step: Tensor, m: Tensor, v: Tensor) -> Tensor:
    """d of ``_single_tensor_radam`` under ``capturable``: float32 tensor scalars, ``torch.where`` branch."""
    (beta1, beta2), eps = group["betas"], group["eps"]
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2**step) / bc2
    adaptive = (bc2**0.5) / v.sqrt().add_(eps)
    update = torch.where(rho_t > 5.0, _rect(rho_t, rho_inf) * adaptive, 1.0)
    return (m / bc1).mul_(lr).mul_(update).neg_()


def _capturable_foreach(group: dict[str, Any], lr: float | Tensor, step: Tensor, m: Tensor, v: Tensor) -> Tensor:
    """d of ``_multi_tensor_radam`` under ``capturable``, in its order of tensor operations."""
    (beta1, beta2), eps = group["betas"], group["eps"]
    rho_inf = 2 / (1 - beta2) - 1
    bc2 = (beta2**step).neg_().add_(1)
    rho_t = (beta2**step).mul_(step).mul_(2).div_(bc2).neg_().add_(rho_inf)
    num = (rho_t - 4).mul_(rho_t - 2).mul_(rho_inf)
    num = num.div_(rho_t * ((rho_inf - 4) * (rho_inf - 2))).sqrt_()
    rect = torch.where(rho_t > 5.0, num, 0.0)
    bc1 = (beta1**step).neg_().add_(1)
    unrect = torch.where(rect > 0, 0.0, 1.0).mul_(lr).div_(bc1).neg_()
    coef = (beta2**step).neg_().add_(1).sqrt_().mul_(lr).mul_(rect).neg_().div_(bc1)
    return v.sqrt().add_(eps).div_(coef).reciprocal_().add_(unrect).mul_(m)

"""NAdam view (``torch/optim/nadam.py``, torch 2.13).

torch's NAdam, with ĝ = -grad under ``maximize`` else grad, step t (already incremented), momentum
decay ψ, bc2 = 1 - β2^t, s = 1 - lr·λ:

    μ_t = β1(1 - ½·0.96^(tψ));   μ_{t+1} = β1(1 - ½·0.96^((t+1)ψ));   Π ← Π·μ_t  (stored ``mu_product``)
    L2:  g' = ĝ + λ·p_b;                     decoupled: p ← s·p, g' = ĝ
    m ← lerp(m, g', 1-β1);   v ← β2·v + (1-β2)·g'^2;   D = sqrt(v / bc2) + eps
    c1 = -lr(1 - μ_t) / (1 - Π);   c2 = -lr·μ_{t+1} / (1 - Π·μ_{t+1})
    p_a = (s·)p_b + c1·g'/D + c2·m/D

Rebuild after the step from the stored m, v, t and Π (the stored Π is the one the step used):

* torch stores p twice, adding the gradient term c1·g'/D and then the momentum term c2·m/D
  (``addcdiv_`` each), so the view returns both, ``Stores((c1·ĝ/D, c2·m/D), s)`` (s = 1 - lr·λ
  under decoupled decay, else 1), for the capture to invert each rounding in turn;
* L2: the explicit g' term holds p_b, so solve p_a = p_b + (c1(ĝ + λ·p_b) + c2·m)/D:
  u = (c1(ĝ + λ·p_a) + c2·m) / (D + c1·λ), whose gradient term is u - c2·m/D. Its condition number κ = D / (D + c1·λ)
  multiplies the rounding of p_a. ``before`` bounds κ from the pre-step state, D ≥ sqrt(β2·min(v_old) / bc2) + eps,
  and takes a clone when κ could exceed 2 (always at the first step, where v_old = 0). The bound
  needs min(v_old) on the host: read for CPU parameters; on an accelerator that would be one host
  sync per parameter, so L2 parameters there take the clone.

Scalar arithmetic mirrors the path torch took: the single-tensor path keeps a Tensor lr as a tensor
(float32 coefficients), the foreach path reads it as a Python float; ``capturable`` computes μ, Π
and the bias correction as tensors on the step's device. ``differentiable=True`` falls back to a clone.
Source: Dozat (2016) "Incorporating Nesterov Momentum into Adam", ``torch/optim/nadam.py``
(``_single_tensor_nadam``, ``_multi_tensor_nadam``) and ``docs/update-formulas.md`` §NAdam.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._shared import KAPPA_MAX, ran_foreach
from .clone import Cloned, Stores
from .view import View


class NAdamView(View):
    """State-aware view for ``torch.optim.NAdam`` (formulas in the module docstring)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        if group["differentiable"]:
            return Cloned.of(p)
        stepped = p.grad is not None or bool(state)  # a never-stepped parameter needs no clone
        if stepped and _l2(group) and not _l2_well_conditioned(group, p, state):
            return Cloned.of(p)
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | Stores | None:
        if p.grad is None or "exp_avg" not in state:
            return None
        foreach = ran_foreach(group)
        c1, c2, bc2 = _coefficients(group, state, foreach)
        g, m, v, p_a = p.grad, state["exp_avg"], state["exp_avg_sq"], p.detach()
        if torch.is_complex(p):  # torch steps complex tensors as pairs of reals
            g, m, v, p_a = (torch.view_as_real(x) for x in (g, m, v, p_a))
        g = -g if group["maximize"] else g
        denom = _denom(v, bc2, group["eps"], foreach)
        wd = group["weight_decay"]
        momentum_term = (m * c2).div_(denom)
        if wd != 0 and not group["decoupled_weight_decay"]:  # c1·λ in p's dtype
            grad_term = (g + wd * p_a).mul_(c1).add_(m * c2).div_(denom.add_(c1, alpha=wd)).sub_(momentum_term)
        else:
            grad_term = (g * c1).div_(denom)
        adds = tuple(torch.view_as_complex(t) if torch.is_complex(p) else t for t in (grad_term, momentum_term))
        return Stores(adds, 1 - group["lr"] * wd if wd != 0 and group["decoupled_weight_decay"] else 1.0)


def _l2(group: dict[str, Any]) -> bool:
    return group["weight_decay"] != 0 and not group["decoupled_weight_decay"]


def _coefficients(group: dict[str, Any], state: dict[str, Any], foreach: bool):
    """``(c1, c2, bc2)`` of the step just taken, in torch's scalar arithmetic for that path."""
    lr, (beta1, beta2), psi = group["lr"], group["betas"], group["momentum_decay"]
    if isinstance(lr, Tensor) and lr.dim() != 0:
        lr = lr.squeeze()
    if group["capturable"]:
        step, mu_product = state["step"], state["mu_product"]
        mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * psi)))
        mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * psi)))
        c1 = -lr * (1.0 - mu) / (1.0 - mu_product)
        c2 = -lr * mu_next / (1.0 - mu_product * mu_next)
        return c1, c2, 1 - beta2**step
    step, mu_product = state["step"].item(), state["mu_product"].item()
    if foreach and isinstance(lr, Tensor):
        lr = lr.item()
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * psi)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * psi)))
    c1 = -lr * (1.0 - mu) / (1.0 - mu_product)
    c2 = (-lr * mu_next) / (1.0 - mu_product * mu_next)
    return c1, c2, 1 - beta2**step


def _denom(v: Tensor, bc2: float | Tensor, eps: float, foreach: bool) -> Tensor:
    """D = sqrt(v / bc2) + eps, in the operation order of the path (a new tensor)."""
    if foreach:
        return v.sqrt().div_(bc2**0.5).add_(eps)
    return v.div(bc2).sqrt_().add_(eps)


def _l2_well_conditioned(group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
    """Conservative pre-step check that the L2 solve's κ = D / (D + c1·λ) stays ≤ ``KAPPA_MAX``.

    D after the step is at least sqrt(β2·min(v_old) / bc2) + eps, and -c1 = lr(1-μ_t)/(1-Π·μ_t)
    is known from the pre-step ``step`` and ``mu_product``. Reads min(v_old) on the host, so it
    answers False (clone) for parameters off the CPU and before the first step.
    """
    if "exp_avg_sq" not in state or p.device.type != "cpu":
        return False
    (beta1, beta2), psi, wd = group["betas"], group["momentum_decay"], group["weight_decay"]
    lr, beta1, beta2 = (float(x) for x in (group["lr"], beta1, beta2))
    t = float(state["step"]) + 1
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (t * psi)))
    k = lr * (1.0 - mu) / (1.0 - float(state["mu_product"]) * mu)
    v = state["exp_avg_sq"]
    v_min = (torch.view_as_real(v) if torch.is_complex(v) else v).amin().item()
    d_min = (beta2 * v_min / (1 - beta2**t)) ** 0.5 + group["eps"]
    return k * float(wd) * KAPPA_MAX <= d_min * (KAPPA_MAX - 1)

"""Adagrad view (``torch/optim/adagrad.py``, torch 2.13).

torch's Adagrad, with ĝ = -grad under ``maximize`` else grad, step t (already incremented),
weight decay λ (L2), lr decay ψ:

    clr = lr / (1 + (t-1)·ψ);   g' = ĝ + λ·p_b;   S ← S + g'^2   (``sum``);   D = sqrt(S) + eps
    p_a = p_b - clr · g' / D

Rebuild after the step from the stored S and t (D is recomputed exactly as torch computed it):

* λ = 0: u = -clr · ĝ / D;
* λ > 0: g' holds p_b, so solve p_a = p_b - clr(ĝ + λ·p_b)/D:  u = -clr(ĝ + λ·p_a) / (D - clr·λ).
  The rounding of p_a is multiplied by κ = D / |D - clr·λ|, unbounded where D ≈ clr·λ (elements
  whose accumulated gradient is about lr·λ). ``before`` computes D after the step from p_b, the grad
  and S (the same operations torch runs) and takes a clone unless max κ ≤ ``KAPPA_MAX``. That check
  reads one number on the host: done for CPU parameters; elsewhere λ > 0 always takes the clone.
* sparse grad (single-tensor path; torch refuses λ > 0 there): the coalesced indices I are the only
  ones that move: u[I] = -clr · ĝ[I] / (sqrt(S[I]) + eps), u = 0 elsewhere.

Scalar arithmetic mirrors the path torch took: the single-tensor and foreach paths keep a Tensor lr
as a tensor (a float32 clr); the fused kernel computes clr in double from lr and t. Under a
GradScaler the fused kernel unscales ``p.grad`` in place, so the rebuild reads the unscaled grad (a
step it skips for an inf is not monitored). ``differentiable=True`` falls back to a clone.
Source: Duchi, Hazan & Singer (2011) "Adaptive Subgradient Methods for Online Learning and
Stochastic Optimization", ``torch/optim/adagrad.py`` (``_single_tensor_adagrad``,
``_multi_tensor_adagrad``, ``_fused_adagrad``), ATen ``FusedAdagradKernel.cpp`` and
``docs/update-formulas.md`` §Adagrad.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._shared import KAPPA_MAX, in_double, like, max_kappa, real, to_scalar
from .clone import Cloned
from .view import View


class AdagradView(View):
    """State-aware view for ``torch.optim.Adagrad`` (formulas in the module docstring)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        if p.grad is None:
            return None
        if group["differentiable"] or (group["weight_decay"] != 0 and not _well_conditioned(group, p, state)):
            return Cloned.of(p)
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | None:
        if p.grad is None or "sum" not in state:
            return None
        clr, g = _clr(group, state["step"]), p.grad
        g = -g if group["maximize"] else g
        if g.is_sparse:
            return _sparse_update(g, state["sum"], clr, group["eps"])
        g, p_a = real(g), real(p.detach())
        denom = _denom(real(state["sum"]), group["eps"])
        wd = group["weight_decay"]
        if wd != 0:
            return like((g + wd * p_a).mul_(-clr).div_(denom.sub_(in_double(clr) * wd)), p)
        return like((g * -clr).div_(denom), p)


def _clr(group: dict[str, Any], step: Tensor) -> float | Tensor:
    """clr = lr / (1 + (t-1)·ψ) in the arithmetic of the path torch took (t already incremented)."""
    lr, lr_decay = to_scalar(group["lr"]), group["lr_decay"]
    if group["fused"]:  # the kernel: double lr, double(float t); kept on the step's device, no sync
        lr = lr.to(torch.float64) if isinstance(lr, Tensor) else lr
        return lr / (1.0 + (step.to(torch.float64) - 1.0) * lr_decay)
    return lr / (1 + (step.item() - 1) * lr_decay)


def _denom(state_sum: Tensor, eps: float) -> Tensor:
    """D = sqrt(S) + eps (a new tensor)."""
    return state_sum.sqrt().add_(eps)


def _sparse_update(g: Tensor, state_sum: Tensor, clr: float | Tensor, eps: float) -> Tensor:
    """u for a sparse grad: -clr·ĝ/(sqrt(S)+eps) on the coalesced indices, 0 elsewhere (dense)."""
    g = g.coalesce()
    std = state_sum.sparse_mask(g)._values().sqrt_().add_(eps)
    step = torch.sparse_coo_tensor(g._indices(), g._values() / std, g.size(), check_invariants=False)
    return step.to_dense().mul_(-clr)


def _well_conditioned(group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
    """Whether the λ > 0 solve keeps κ = D / |D - clr·λ| ≤ ``KAPPA_MAX`` on every element.

    D after the step is computed now from p_b, the grad and S, with torch's own operations; the
    maximum is read on the host, so parameters off the CPU (and sparse grads) answer False.
    """
    if p.device.type != "cpu":
        return False
    grad = p.grad
    assert grad is not None  # asked only of a parameter with a grad
    if grad.is_sparse or "sum" not in state:
        return False
    wd, step = group["weight_decay"], state["step"] + 1
    clr = _clr(group, step)
    g = real(-grad if group["maximize"] else grad)
    g = g.add(real(p.detach()), alpha=wd)
    denom = _denom(real(state["sum"]).addcmul(g, g), group["eps"])
    return max_kappa(denom, clr * wd) <= KAPPA_MAX

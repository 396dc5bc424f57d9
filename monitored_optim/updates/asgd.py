"""ASGD view (``torch/optim/asgd.py``, torch 2.13).

torch's averaged SGD, with ĝ = -grad under ``maximize`` else grad, decay λ (``lambd``), weight
decay w (L2), and η the state's ``eta`` *before* the step (the step overwrites it with the next one):

    g' = ĝ + w·p_b;   p_a = s·p_b - η·g'   with s = 1 - λ·η;   ax ← average of p (not needed here)

Rebuild after the step, with η kept by ``before`` (a 0-dim tensor; at the first step, torch's own
initial value: lr as a float32/default-dtype tensor):

    p_b = (p_a + η·ĝ) / (s - η·w),   so   u = -(η·ĝ + (1 - s + η·w)·p_a) / (s - η·w).

The single-tensor path stores p twice (``mul_(s)``, then ``add_(g', alpha=-η)``): the view returns
``Stores((d,), s)`` with the second store's d = p_a - s·p_b = s·u + (1 - s)·p_a, for the capture to
invert both roundings; the foreach path folds λ into the gradient, one store of u.

The divisor s - η·w = 1 - η(λ + w) is a constant of the step: well conditioned for any sane η.
Rebuilding η from the current lr instead would be wrong as soon as lr changes (a scheduler).

Scalar arithmetic mirrors the path torch took: the single-tensor path forms s in double from
``eta.item()``, or as a float32 tensor under ``capturable`` (rounding λ·η at the 1e-8 level, which
matters in float64); the foreach path folds λ into the gradient (s exact). No host read: η stays a
tensor. ``differentiable=True`` falls back to a clone. Source: Polyak & Juditsky (1992)
"Acceleration of Stochastic Approximation by Averaging", ``torch/optim/asgd.py``
(``_single_tensor_asgd``, ``_multi_tensor_asgd``) and ``docs/update-formulas.md`` §ASGD.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _get_scalar_dtype

from ._shared import like, ran_foreach, real, to_scalar
from .clone import Cloned, Stores
from .view import View


class AsgdView(View):
    """State-aware view for ``torch.optim.ASGD`` (formulas in the module docstring)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | Tensor | None:
        if p.grad is None:
            return None
        if group["differentiable"]:
            return Cloned.of(p)
        if "eta" in state:
            return state["eta"].clone()
        return torch.as_tensor(to_scalar(group["lr"]), device=p.device, dtype=_get_scalar_dtype()).clone()

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], eta: Any) -> Tensor | Stores | None:
        if p.grad is None or not isinstance(eta, Tensor):
            return None
        lambd, wd = group["lambd"], group["weight_decay"]
        if group["capturable"] and not ran_foreach(group):
            s = (1 - lambd * eta).double()  # float32 tensor arithmetic, as torch's param.mul_(1 - λ·η)
        else:
            s = 1 - lambd * eta.double()
        eta = eta.double()
        g, p_a = real(-p.grad if group["maximize"] else p.grad), real(p.detach())
        k = (1 - s) + eta * wd
        u = (g * eta).add_(p_a * k).div_(-(s - eta * wd))
        if ran_foreach(group):  # lambda folded into the gradient: one store
            return like(u, p)
        return Stores((like(u.mul_(s).sub_(p_a * (s - 1)), p),), s)  # the second store's d = s*u + (1 - s)*p_a

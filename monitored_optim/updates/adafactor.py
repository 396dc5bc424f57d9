"""Adafactor view (``torch/optim/_adafactor.py``, torch 2.13).

torch's Adafactor, with ĝ = -grad under ``maximize`` else grad, step t (already incremented),
n = numel(p), clipping threshold d, (eps1, eps2) = ``eps``, s = 1 - lr·λ:

    ρ_t = min(lr, t^-½);   α = max(eps2, ‖p_b‖/√n)·ρ_t                       (before the decay)
    p ← s·p
    factored (ndim ≥ 2, over the last two dims):  R ← lerp(R, mean_{-1}(ĝ²), t^τ);  C ← lerp(C, mean_{-2}(ĝ²), t^τ)
        V̂ = R·C / max(mean_{-2}(R), eps1)
    vector:  V̂ = V ← lerp(V, ĝ², t^τ)
    U = ĝ / sqrt(max(V̂, eps1²));   p_a = s·p_b - α/max(1, ‖U‖/(√n·d)) · U

eps1 = None means ``finfo(dtype).eps`` of the group's first parameter that has a grad (on the
foreach path: of whichever dtype torch groups first, so a foreach group of mixed dtypes falls back to
a clone).

Rebuild after the step: U is recomputed bit for bit from the stored R and C (or V), the grad and
eps1. The only trace of p_b is the scalar ‖p_b‖, which ``before`` keeps as a 0-dim tensor on p's
device (one reduction, no clone). Then d = -α/max(1, ‖U‖/(√n·d))·U and, under weight decay, ``Stores((d,), s)``
(u = d without weight decay). The scalars are computed on the device in float64, which is what
torch's Python floats are; a Tensor lr makes α float32 tensor arithmetic, as in torch.
Source: Shazeer & Stern (2018) "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
``torch/optim/_adafactor.py`` (``_single_tensor_adafactor``, ``_multi_tensor_adafactor``) and
``docs/update-formulas.md`` §Adafactor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..workspace import PART_ELEMENTS
from .clone import Cloned, Rows, Stores
from .view import View


class AdafactorView(View):
    """State-aware view for ``torch.optim.Adafactor`` (formulas in the module docstring)."""

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Tensor | Cloned:
        if group["eps"][0] is None and group["foreach"] and len(_dtypes_with_grad(group)) > 1:
            return Cloned.of(p)
        # also without a grad: a closure passed to step() may create one
        return p.detach().norm(2)  # torch's own call, so the same rounding

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Tensor) -> Stores | Rows | None:
        if p.grad is None or "step" not in state:
            return None
        eps1, eps2 = group["eps"]
        if eps1 is None:
            eps1 = torch.finfo(_dtypes_with_grad(group)[0]).eps
        grad = -p.grad if group["maximize"] else p.grad
        lr = group["lr"]
        if isinstance(lr, Tensor) and lr.dim() != 0:
            lr = lr.squeeze()
        root_n = p.numel() ** 0.5
        alpha = _alpha(snapshot, root_n, eps2, min(lr, 1 / (state["step"].item() ** 0.5)))
        wd = group["weight_decay"]
        s = 1 - lr * wd if wd != 0 else 1.0
        if grad.dim() == 2 and grad.is_contiguous() and p.is_contiguous() and p.numel() > PART_ELEMENTS:
            return _rows(grad, state, eps1, alpha, root_n * group["d"], s)
        update = _normalized(grad, state, eps1)
        clip = _at_least(update.norm(2).double().div_(root_n * group["d"]), 1.0)
        update.mul_(-alpha / clip.to(alpha.dtype))
        return Stores((update,), s)


def _dtypes_with_grad(group: dict[str, Any]) -> list[torch.dtype]:
    """Dtypes of the group's parameters that have a grad, in order of first appearance."""
    return list(dict.fromkeys(q.dtype for q in group["params"] if q.grad is not None))


def _normalized(grad: Tensor, state: dict[str, Any], eps1: float) -> Tensor:
    """U = ĝ / sqrt(max(V̂, eps1²)) from the post-step factors, in torch's operations (a new tensor)."""
    if grad.dim() > 1:
        row_var, col_var = state["row_var"], state["col_var"]
        var_estimate = row_var @ col_var
        var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        var_estimate = state["variance"].clone()
    return var_estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)


def _rows(grad: Tensor, state: dict[str, Any], eps1: float, alpha: Tensor, threshold: float,
          s: float | Tensor) -> Rows:
    """The update of a large factored matrix in blocks of rows
    (:data:`~monitored_optim.workspace.PART_ELEMENTS` elements
    each): U is rebuilt per block from the rows of R and all of C (the same products, element by
    element, as torch's R·C), a first pass takes ‖U‖ for the clipping, and the blocks of
    d = -α/max(1, ‖U‖/threshold)·U are built again one at a time when the capture asks for them."""
    rows, cols = grad.shape
    row_var, col_var = state["row_var"], state["col_var"]
    row_mean = row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1)
    step = max(1, PART_ELEMENTS // cols)
    starts = range(0, rows, step)

    def block(a: int) -> Tensor:
        b = min(rows, a + step)
        v = (row_var[a:b] @ col_var).div_(row_mean)
        return v.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad[a:b])

    squares = grad.new_zeros((), dtype=torch.float64)  # one accumulator: no small tensor kept per block
    for a in starts:
        squares.add_(torch.linalg.vector_norm(block(a)).double().square())
    factor = -alpha / _at_least(squares.sqrt_().div_(threshold), 1.0).to(alpha.dtype)

    def slices() -> Iterator[tuple[slice, Stores]]:
        for a in starts:
            yield slice(a * cols, min(rows, a + step) * cols), Stores((block(a).mul_(factor).view(-1),), s)

    return Rows(slices)


def _alpha(norm_before: Tensor, root_n: float, eps2: float, rho: float | Tensor) -> Tensor:
    """α = max(eps2, ‖p_b‖/√n)·ρ_t as a 0-dim tensor: float64 (Python float arithmetic), or ρ's
    dtype when ρ is a Tensor lr (torch then multiplies a Python float by that tensor)."""
    rms = _at_least(norm_before.double().div_(root_n), eps2)
    if isinstance(rho, Tensor):
        return rms.to(rho.dtype) * rho
    return rms.mul_(rho)


def _at_least(x: Tensor, floor: float) -> Tensor:
    """``max(floor, x)`` as torch's step takes it, Python's ``max`` of a float: ``floor`` where x is NaN
    (a parameter or update holding NaN), unlike ``clamp``."""
    return torch.where(x > floor, x, floor)

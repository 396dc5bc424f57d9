"""Hugging Face Adafactor view (transformers 5, ``transformers/optimization.py``, ``Adafactor.step``).

Adafactor (Shazeer & Stern, 2018) as transformers writes it, with step t (already incremented),
RMS = ‖p_b‖/√n, which the step keeps in ``state["RMS"]``, clipping threshold c, β1 (None: no first
moment), weight decay λ and (eps1, eps2) = ``eps``:

    lr_t = max(eps2, RMS)·ρ (``scale_parameter``; else ρ), ρ = lr, or min(1e-2 | 1e-6·t, t^-½) under
           ``relative_step`` (``warmup_init``: 1e-6·t)
    factored (ndim ≥ 2, over the last two dims):  R, C the decayed means of g² + eps1 by row and column
        U = rsqrt(R / mean_{-1}(R)) ⊗ rsqrt(C) · g;     vector: U = rsqrt(V)·g
    U ← U / max(1, RMS(U)/c) · lr_t;   with β1: m ← β1·m + (1-β1)·U, U = m
    p ← s·p with s = 1 - λ·lr_t;   p ← p - U

Rebuild after the step, with nothing kept before it (RMS is in the state): lr_t from the state and
the group with the step's own expressions; with β1, d = -m, the stored moment itself; else U rebuilt
from the stored R and C (or V) and the grad in the step's operations, the clipping from its norm;
u = ``Stores((d,), s)``, the stores the capture inverts in turn. A large factored matrix (2-D, more
than ``PART_ELEMENTS`` elements) is rebuilt a block of rows at a time (``Rows``), after a first pass
for the clipping norm. bf16/fp16 parameters are stepped in float32 copies, as the rebuild is.
Source: transformers 5.24 ``transformers/optimization.py`` (``Adafactor._get_lr``,
``Adafactor._approx_sq_grad``, ``Adafactor.step``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..stats import LOW_PRECISION
from ..workspace import PART_ELEMENTS
from .clone import Rows, Scaled, Stores
from .view import View


class HfAdafactorView(View):
    """State-aware view for ``transformers.optimization.Adafactor`` (module docstring)."""

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Stores | Rows | None:
        if p.grad is None or not state.get("step"):
            return None
        lr = _lr(group, state)
        s = 1 - group["weight_decay"] * lr if group["weight_decay"] != 0 else 1.0
        grad = p.grad.float() if p.grad.dtype in LOW_PRECISION else p.grad
        large = grad.dim() == 2 and grad.is_contiguous() and grad.numel() > PART_ELEMENTS
        if group["beta1"] is not None:
            m = state["exp_avg"]
            if large:
                return Rows(lambda: ((span, Stores((Scaled(m.view(-1)[span], -1.0),), s))
                                     for span in _spans(m.shape)))
            return Stores((Scaled(m, -1.0),), s)
        if large:
            return _rows(grad, state, lr, group["clip_threshold"], s)
        update = _normalized(grad, state)
        update.div_((_rms(update) / group["clip_threshold"]).clamp_(min=1.0)).mul_(lr)
        return Stores((update.neg_(),), s)


def _lr(group: dict[str, Any], state: dict[str, Any]) -> float | Tensor:
    """``Adafactor._get_lr``: the step's lr_t, from the group and the post-step state."""
    rel_step_sz = group["lr"]
    if group["relative_step"]:
        min_step = 1e-6 * state["step"] if group["warmup_init"] else 1e-2
        rel_step_sz = min(min_step, 1.0 / math.sqrt(state["step"]))
    param_scale = max(group["eps"][1], state["RMS"]) if group["scale_parameter"] else 1.0
    return param_scale * rel_step_sz


def _rms(t: Tensor) -> Tensor:
    return t.norm(2) / (t.numel() ** 0.5)


def _normalized(grad: Tensor, state: dict[str, Any]) -> Tensor:
    """U before clipping, from the post-step factors (``_approx_sq_grad``) or V, times g (new)."""
    if grad.dim() >= 2:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
        return torch.mul(r_factor, col.unsqueeze(-2).rsqrt()).mul_(grad)
    return state["exp_avg_sq"].rsqrt().mul_(grad)


def _spans(shape: torch.Size) -> Iterator[slice]:
    """Flat spans of whole rows of a (rows, cols) matrix, about ``PART_ELEMENTS`` elements each."""
    rows, cols = shape
    step = max(1, PART_ELEMENTS // cols)
    return (slice(a * cols, min(rows, a + step) * cols) for a in range(0, rows, step))


def _rows(grad: Tensor, state: dict[str, Any], lr: float | Tensor, threshold: float, s: float | Tensor) -> Rows:
    """d = -U/max(1, RMS(U)/c)·lr_t of a large 2-D matrix a block of rows at a time: U per block from
    the rows of R (divided by their mean over all of R's row) and all of C, the same products element
    by element as the step's; a first pass takes ‖U‖ for the clipping."""
    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
    r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
    c_factor = col.unsqueeze(-2).rsqrt()
    cols = grad.shape[1]

    def block(span: slice) -> Tensor:
        a, b = span.start // cols, span.stop // cols
        return torch.mul(r_factor[a:b], c_factor).mul_(grad[a:b])

    squares = grad.new_zeros((), dtype=torch.float64)
    for span in _spans(grad.shape):
        squares.add_(torch.linalg.vector_norm(block(span)).double().square())
    clip = (squares.sqrt_() / grad.numel() ** 0.5 / threshold).clamp_(min=1.0).to(grad.dtype)

    def slices() -> Iterator[tuple[slice, Stores]]:
        for span in _spans(grad.shape):
            yield span, Stores((block(span).div_(clip).mul_(lr).neg_().view(-1),), s)

    return Rows(slices)

"""SGD view (``torch/optim/sgd.py``, torch 2.13).

torch's SGD, with ĝ = -grad under ``maximize`` else grad, lr γ, weight decay λ, momentum μ,
dampening τ:

    g' = ĝ + λ·p_b;   b ← μ·b + (1-τ)·g'  (b = g' at the first step);
    d = g' + μ·b (nesterov) or b (momentum) or g' (no momentum);   p_a = p_b - γ·d

Rebuild after the step, without p_b:

* momentum, no nesterov: u = -γ·b (weight decay and dampening are already inside b);
* otherwise p_b = (p_a + γ(ĝ + μ·b)) / (1 - γλ) solves g', so u = -γ(ĝ + λ·p_a + μ·b) / (1 - γλ)
  (μ·b omitted without momentum); the divisor 1 - γλ is a constant, so this is well conditioned;
* trap: ``_multi_tensor_sgd`` with nesterov, λ = 0 and not maximize adds μ·b into ``p.grad`` in
  place, so after the step ``p.grad`` already holds d and u = -γ·p.grad. Which path ran is decided
  exactly as ``torch.optim.sgd.sgd`` decides it.

``differentiable=True`` may also rewrite ``p.grad`` in place, and 1 - γλ near 0 (a huge weight
decay) makes the solve ill-conditioned: those parameters fall back to a clone.
Source: ``torch/optim/sgd.py`` and ``docs/update-formulas.md`` §SGD.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._shared import decay_solvable, ran_foreach, to_scalar
from .clone import Cloned, Scaled
from .view import View


def _dense(g: Tensor) -> Tensor:
    return g.coalesce().to_dense() if g.is_sparse else g


class SgdView(View):
    """State-aware view for ``torch.optim.SGD`` (see the module docstring for the formulas)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        exact_from_buffer = group["momentum"] != 0 and not group["nesterov"]
        if group["differentiable"] or not (exact_from_buffer or _is_zero(group["weight_decay"])
                                           or decay_solvable(group)):
            return Cloned.of(p)
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | Scaled | None:
        if p.grad is None:
            return None
        lr, momentum, wd = to_scalar(group["lr"]), group["momentum"], group["weight_decay"]
        if momentum != 0 and not group["nesterov"]:
            return Scaled(state["momentum_buffer"], -lr)
        if group["nesterov"] and _is_zero(wd) and not group["maximize"] and ran_foreach(group):
            return Scaled(_dense(p.grad), -lr)
        if momentum == 0 and _is_zero(wd):  # p.add_(±grad, alpha=-lr): stored in one rounding, as it is inverted
            return Scaled(_dense(p.grad), lr if group["maximize"] else -lr)
        d = _dense(p.grad)
        d = d.neg() if group["maximize"] else d.clone()
        if not _is_zero(wd):
            d.add_(p.detach() * wd)
        if momentum != 0:
            d.add_(state["momentum_buffer"], alpha=momentum)
        return d.mul_(-lr / (1.0 - lr * wd))

    def keeps_grad(self, group: dict[str, Any]) -> bool:
        """Whether the step leaves ``p.grad`` as it was (not under the nesterov trap above, nor
        ``differentiable``), so that its sums may be taken after the step."""
        trap = group["nesterov"] and _is_zero(group["weight_decay"]) and not group["maximize"] and ran_foreach(group)
        return not (trap or group["differentiable"])

    def fusable(self, group: dict[str, Any]) -> bool:
        """Whether :meth:`fused` serves this group: a number lr, and momentum without nesterov (u = -γ·b)
        or plain SGD without weight decay (u = ∓γ·grad)."""
        plain = group["momentum"] == 0 and _is_zero(group["weight_decay"])
        return not isinstance(group["lr"], Tensor) and not group["differentiable"] and (
            (group["momentum"] != 0 and not group["nesterov"]) or plain)

    def fused(self, group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]]
              ) -> tuple[Any, tuple[Any, ...], Tensor, None] | None:
        """The fused form (:mod:`monitored_optim.capture.fused`): ``(buffers, (b,), -γ, None)`` with the momentum
        buffers b (the dense grads, sign flipped under ``maximize``, for plain SGD); None where not
        :meth:`fusable` or a buffer is missing."""
        if not self.fusable(group):
            return None
        plain = group["momentum"] == 0
        bufs = [p.grad if plain else st.get("momentum_buffer") for p, st in zip(params, states)]
        if any(b is None or b.is_sparse or b.dtype != p.dtype for b, p in zip(bufs, params)):
            return None
        factor = group["lr"] if plain and group["maximize"] else -group["lr"]
        return buffers, (bufs,), torch.full((len(params),), factor, dtype=torch.float64, device=params[0].device), None


def buffers(xs: list[Tensor]) -> list[Tensor]:
    """The fused form's rebuild of SGD: the momentum buffers (or grads) themselves, d = -γ·b."""
    return list(xs)


def _is_zero(x: float | Tensor) -> bool:
    """``x == 0`` as torch's SGD decides it (a Tensor weight decay is read, as torch reads it)."""
    return float(x) == 0.0 if isinstance(x, Tensor) else x == 0

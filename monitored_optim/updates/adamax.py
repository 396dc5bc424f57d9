"""Adamax view (``torch/optim/adamax.py``, torch 2.13).

torch's Adamax, with ĝ = -grad under ``maximize`` else grad, step t (already incremented),
weight decay λ (L2), bc1 = 1 - β1^t:

    g' = ĝ + λ·p_b;   m ← lerp(m, g', 1-β1);   e ← max(β2·e, |g'| + eps)   (``exp_inf``)
    p_a = p_b - (lr / bc1) · m / e

Rebuild after the step, from the stored m, e and t alone: u = -(lr / bc1) · m / e (exact for any
λ: the decay lives inside m and e; p_b is never needed).

Scalar arithmetic mirrors the path torch took: the single-tensor path keeps a Tensor lr as a tensor
(a float32 ``lr / bc1``), the foreach path reads it as a Python float; ``capturable`` computes
(β1^t - 1) / lr as a float32 tensor and divides by ``e·(β1^t - 1)/lr``. ``differentiable=True``
falls back to a clone. Source: Kingma & Ba (2015) "Adam: A Method for Stochastic Optimization" §7.1,
``torch/optim/adamax.py`` (``_single_tensor_adamax``, ``_multi_tensor_adamax``) and
``docs/update-formulas.md`` §Adamax.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._shared import like, ran_foreach, real, to_scalar
from .clone import Cloned
from .view import View


class AdamaxView(View):
    """State-aware view for ``torch.optim.Adamax`` (formulas in the module docstring)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        if group["differentiable"]:
            return Cloned.of(p)
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | None:
        if p.grad is None or "exp_inf" not in state:
            return None
        m, e = real(state["exp_avg"]), real(state["exp_inf"])
        lr, beta1 = to_scalar(group["lr"]), group["betas"][0]
        if group["capturable"]:
            neg_bc = (beta1 ** state["step"] - 1) / lr
            return like(m / (e * neg_bc), p)
        if ran_foreach(group) and isinstance(lr, Tensor):
            lr = lr.item()
        bc = 1 - beta1 ** state["step"].item()
        return like((m / e).mul_(-(lr / bc)), p)

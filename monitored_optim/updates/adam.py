"""Adam / AdamW view (``torch/optim/adam.py``, torch 2.13; AdamW inherits ``Adam.step``).

torch's Adam, with ĝ = -grad under ``maximize`` else grad, step t (already incremented),
bc1 = 1 - β1^t, bc2 = 1 - β2^t, s = 1 - lr·λ:

    L2:         g' = ĝ + λ·p_b;                     decoupled (AdamW): p ← s·p, g' = ĝ
    m ← lerp(m, g', 1-β1);   v ← β2·v + (1-β2)·g'^2;   v̂ = max(v̂, v) with amsgrad else v
    d = -(lr / bc1) · m / (sqrt(v̂) / sqrt(bc2) + eps);   p_a = (s·)p_b + d

Rebuild after the step from the stored m, v (or v̂) and t, without p_b:

* L2 or no weight decay: u = d (the decay lives inside m and v);
* decoupled: p_b = (p_a - d) / s, so u = (d - (1 - s)·p_a) / s (s is a constant; where |s| < 1/2,
  lr·λ near 1, the parameter falls back to a clone).

Hyperparameters are read raw from the parameter's own group: a Tensor lr or beta, or the
``capturable``/``differentiable`` tensor step, makes the bias corrections float32 tensor arithmetic
exactly as in torch. Source: Kingma & Ba (2015), Loshchilov & Hutter (2019), ``torch/optim/adam.py``
(``_single_tensor_adam``) and ``shared/reference/update-formulas.md`` §Adam.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._shared import decay_solvable
from .clone import Cloned


class AdamView:
    """State-aware view for ``torch.optim.Adam`` and ``torch.optim.AdamW`` (formulas above)."""

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        decoupled = group["decoupled_weight_decay"] and group["weight_decay"] != 0
        if decoupled and not decay_solvable(group):
            return Cloned(p.detach().clone())  # lr·λ near 1: dividing by s would amplify rounding
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | None:
        if p.grad is None or "exp_avg" not in state:
            return None
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        step = state["step"]
        if not (group["capturable"] or group["differentiable"]) and isinstance(step, Tensor):
            step = step.double()  # torch uses step.item() in Python doubles; same values, no host read
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        step_size = lr / bc1
        bc2_sqrt = bc2.sqrt() if isinstance(bc2, Tensor) else bc2**0.5
        m = state["exp_avg"]
        v = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
        p_a = p.detach()
        if torch.is_complex(p):  # torch steps complex tensors as pairs of reals
            m, v, p_a = torch.view_as_real(m), torch.view_as_real(v), torch.view_as_real(p_a)
        u = v.sqrt().div_(bc2_sqrt).add_(eps)  # the denominator, then u in the same buffer
        if m.dtype in (torch.float16, torch.bfloat16):  # addcdiv_ divides in float32 (opmath)
            m, u = m.float(), u.float()
        u = torch.div(m, u, out=u).mul_(-step_size)
        wd = group["weight_decay"]
        if wd != 0 and group["decoupled_weight_decay"]:
            s = 1 - lr * wd
            if isinstance(s, Tensor):
                u.sub_(p_a * (1 - s)).div_(s)
            else:
                u.add_(p_a, alpha=-(1 - s)).div_(s)
        return torch.view_as_complex(u) if torch.is_complex(p) else u

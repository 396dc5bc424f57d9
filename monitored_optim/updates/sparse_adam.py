"""SparseAdam view (``torch/optim/sparse_adam.py`` and ``torch/optim/_functional.py``, torch 2.13).

torch's SparseAdam, with the coalesced sparse grad (negated under ``maximize``) holding values at
the index set I, the Python ``int`` step t (already incremented), bc1 = 1 - β1^t, bc2 = 1 - β2^t:

    m[I] ← m[I] + (1-β1)(g_I - m[I]);   v[I] ← v[I] + (1-β2)(g_I^2 - v[I])   (m, v dense, elsewhere kept)
    p[I] ← p[I] - lr·sqrt(bc2)/bc1 · m[I] / (sqrt(v[I]) + eps);   p elsewhere unchanged

eps is added to sqrt(v), not to the bias-corrected sqrt(v/bc2) as in Adam. There is no weight decay.

Rebuild after the step from the stored dense m, v and the grad's indices (their values are not
needed): u[I] = -lr·sqrt(bc2)/bc1 · m[I] / (sqrt(v[I]) + eps), u = 0 elsewhere. A grad with no
stored values is a skipped step (u = 0, although t still advanced). A Tensor lr makes the step
size float32 tensor arithmetic, as in torch. Source: ``torch/optim/_functional.py``
(``sparse_adam``) and ``docs/update-formulas.md`` §SparseAdam.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .view import View


class SparseAdamView(View):
    """State-aware view for ``torch.optim.SparseAdam`` (formulas in the module docstring)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | None:
        if p.grad is None or "exp_avg" not in state:
            return None
        grad = p.grad.coalesce()
        if grad._values().numel() == 0:
            return None
        index = tuple(grad._indices())
        step, (beta1, beta2), eps = state["step"], group["betas"], group["eps"]
        lr = group["lr"]
        if isinstance(lr, Tensor) and lr.dim() != 0:
            lr = lr.squeeze()
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        m, v = state["exp_avg"][index], state["exp_avg_sq"][index]
        u = torch.zeros_like(p, memory_format=torch.preserve_format)
        u[index] = -step_size * m.div_(v.sqrt_().add_(eps))
        return u

"""Optimizer-state health, from the step's moments and the state the optimizer keeps (no clone).

* ``health/zero_grad``: parameters whose grad is entirely zero (a dead layer; with momentum it
  still moves, so ``health/unchanged`` misses it). From the grad's moments: free.
* ``normalized_update_rms/{name}``: RMS(u) / lr of its group, u the stored change. For Adam this
  sits near 0.2 with betas (0.9, 0.95) after warmup (RMS(m̂/√v̂) of noise-dominated grads); a
  drift says the second moment has gone stale. From the moments: free.
* ``eps_dominated/{name}``: for optimizers that keep ``exp_avg_sq`` (Adam, AdamW, NAdam, RAdam),
  the share of elements where the bias-corrected second moment's square root is below ``eps``
  (``max_exp_avg_sq`` under amsgrad), so that eps, not the gradient, sets the step size (a known
  cause of shrinking updates in bf16). One comparison pass over v.
* ``state_norm/{key}/{name}``: the L2 norm of each tensor the optimizer keeps for the parameter
  with the parameter's shape (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...): the cheap
  form of dumping the optimizer state. One pass over each.

Source: Kingma & Ba (2015) for the moments; ``torch/optim/adam.py`` for the state keys.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..pieces import NORM, SUM
from .base import Family, Step

STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "grad_avg",
              "acc_delta", "exp_inf", "ax", "prev", "step_size", "variance")
"""The per-parameter state tensors of torch's optimizers: the ``state_norm`` keys that have a row in
the one collective under ``torch.distributed`` (in one process every state tensor is measured)."""


class OptimizerState(Family):
    """The ``state`` family (see the module docstring)."""

    name = "state"
    series = ("normalized_update_rms", "eps_dominated", "state_norm")
    keyed = ("state_norm",)
    run_wide = ("health/zero_grad",)
    pieces = {"eps_count": SUM, **{f"state_norm:{key}": NORM for key in STATE_KEYS}}

    def part(self, name: str, whole: Tensor, u: Tensor, span: slice | None, state: dict[str, Any],
             group: dict[str, Any]) -> dict[str, Tensor]:
        pieces = {}
        for key, value in state.items():
            if isinstance(value, Tensor) and value.shape == u.shape and value.is_floating_point():
                pieces[f"state_norm:{key}"] = torch.linalg.vector_norm(value.detach().float()).double().reshape(1)
        v = state.get("max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq")
        eps, betas, step = group.get("eps"), group.get("betas"), state.get("step")
        if isinstance(v, Tensor) and isinstance(eps, float) and betas is not None and step is not None:
            bias = 1 - betas[1] ** (step.double() if isinstance(step, Tensor) else float(step))
            below = (v.detach().double() < (eps * eps) * bias).sum().double().reshape(1)
            pieces["eps_count"] = below
        return pieces

    def figures(self, step: Step) -> dict[str, float]:
        table, out = step.table, {}
        n = table.n[:, 0].tolist()
        zero_grad = table.all_zero[:, 1].tolist()
        rms_u = (table.sq_norm[:, 2] / table.n[:, 0].clamp(min=1)).sqrt().tolist()
        count = 0
        for name, pieces, lr, size, rms, zero, (_, grad, moved) in zip(step.names, step.pieces, step.lrs, n, rms_u,
                                                                       zero_grad, table.has.tolist()):
            count += grad and zero
            if lr and moved:
                out[f"normalized_update_rms/{name}"] = rms / lr
            if "eps_count" in pieces and size:
                out[f"eps_dominated/{name}"] = pieces["eps_count"][0] / size
            for key, value in pieces.items():
                if key.startswith("state_norm:"):
                    out[f"state_norm/{key.split(':', 1)[1]}/{name}"] = value[0]
        out["health/zero_grad"] = float(count)
        return {tag: v for tag, v in out.items() if math.isfinite(v)}

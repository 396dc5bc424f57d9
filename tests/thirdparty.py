"""A third-party optimizer, importable by name (for pickling and fallback tests): sign SGD."""

from __future__ import annotations

import torch


class SignSGD(torch.optim.Optimizer):
    """p <- p - lr * sign(grad) (Bernstein et al., 2018); keeps no state."""

    def __init__(self, params, lr: float = 1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])

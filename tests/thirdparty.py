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


class MomentumSGD(torch.optim.Optimizer):
    """Heavy-ball SGD whose methods take more arguments than torch's, as third-party optimizers' do.

    ``load_state_dict(state, move_to_device=True, *, note=None)`` names its state dict ``state``
    (pytorch-optimizer's Lookahead) and takes bitsandbytes' ``move_to_device``; ``state_dict`` takes a
    ``destination`` and a keyword-only ``note`` (saved in the dict); ``step`` a ``scale`` of the
    learning rate and a keyword-only ``sign``; ``zero_grad`` a keyword-only list of group indices.
    ``count`` (``int``, ``float`` or ``torch.tensor``; ``None``: no count) keeps the number of steps
    taken in ``param_groups[i]["step"]`` as pytorch-optimizer and timm do; the momentum buffers in
    ``state[p]`` carry no count.
    """

    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.9, count=None):
        super().__init__(params, {"lr": lr, "momentum": momentum} if count is None else
                         {"lr": lr, "momentum": momentum, "step": count(0)})

    @torch.no_grad()
    def step(self, closure=None, scale: float = 1.0, *, sign: bool = False):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(group["momentum"]).add_(p.grad.sign() if sign else p.grad)
                    p.add_(buf, alpha=-group["lr"] * scale)
            if "step" in group:
                group["step"] = group["step"] + 1
        return loss

    def zero_grad(self, set_to_none: bool = True, *, groups=None) -> None:
        for i, group in enumerate(self.param_groups):
            if groups is None or i in groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad = None if set_to_none else p.grad.zero_()

    def state_dict(self, destination=None, *, note=None):
        sd = super().state_dict()
        if note is not None:
            sd["note"] = note
        if destination is None:
            return sd
        destination.update(sd)
        return destination

    def load_state_dict(self, state, move_to_device: bool = True, *, note=None) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "note"})
        self.loaded_with = (state.get("note"), move_to_device, note)


class SignMomentum(torch.optim.Optimizer):
    """Sign-momentum SGD (signum, Bernstein et al., 2018): m <- lerp(m, grad, 1 - beta),
    p <- p - lr * sign(m); keeps ``momentum_buffer`` in ``state[p]``."""

    def __init__(self, params, lr: float = 1e-2, beta: float = 0.9):
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    m = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    m.lerp_(p.grad, 1 - group["beta"])
                    p.add_(m.sign(), alpha=-group["lr"])

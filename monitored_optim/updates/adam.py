"""Adam / AdamW view (``torch/optim/adam.py``, torch 2.13; AdamW inherits ``Adam.step``).

torch's Adam, with ĝ = -grad under ``maximize`` else grad, step t (already incremented),
bc1 = 1 - β1^t, bc2 = 1 - β2^t, s = 1 - lr·λ:

    L2:         g' = ĝ + λ·p_b;                     decoupled (AdamW): p ← s·p, g' = ĝ
    m ← lerp(m, g', 1-β1);   v ← β2·v + (1-β2)·g'^2;   v̂ = max(v̂, v) with amsgrad else v
    d = -(lr / bc1) · m / (sqrt(v̂) / sqrt(bc2) + eps);   p_a = (s·)p_b + d

Rebuild after the step from the stored m, v (or v̂) and t, without p_b:

* L2 or no weight decay: d (the decay lives inside m and v);
* decoupled: ``Stores((d,), s)``, the two stores p ← s·p, p ← p + d, which the capture inverts in
  turn (where |s| < 1/2, lr·λ near 1, the parameter falls back to a clone).

Several parameters at once (``update_many``, float32/float64 ones): with b = sqrt(bc2),
d = c·r where c = -(lr / bc1)·b and r = m / (sqrt(v̂) + eps·b), the same quotient rearranged (a few
ulp apart). The coefficients of all parameters come from one stack of their steps (read as Python
floats, as torch's single-tensor step reads them, where the steps live on the CPU and the
hyperparameters are numbers; as tensors otherwise), r from ``torch._foreach_*`` ops, and d is
returned as ``Scaled(r, c)`` (inside ``Stores((·,), s)`` under decoupled decay).

Hyperparameters are read raw from the parameter's own group: a Tensor lr or beta, or the
``capturable``/``differentiable`` tensor step, makes the bias corrections float32 tensor arithmetic
exactly as in torch. Source: Kingma & Ba (2015), Loshchilov & Hutter (2019), ``torch/optim/adam.py``
(``_single_tensor_adam``) and ``docs/update-formulas.md`` §Adam.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from ..stats import LOW_PRECISION
from ._shared import decay_solvable, to_scalar
from .clone import Cloned, Scaled, Stores
from .view import View

_BATCHED = (torch.float32, torch.float64)


class AdamView(View):
    """State-aware view for ``torch.optim.Adam`` and ``torch.optim.AdamW`` (formulas above)."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        decoupled = group["decoupled_weight_decay"] and group["weight_decay"] != 0
        if decoupled and not decay_solvable(group):
            return Cloned.of(p)  # lr·λ near 1: dividing by s would amplify rounding
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | Stores | None:
        if p.grad is None or "exp_avg" not in state:
            return None
        lr, (beta1, beta2), eps = to_scalar(group["lr"]), group["betas"], group["eps"]
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
        if m.dtype in LOW_PRECISION:  # addcdiv_ divides in float32 (opmath)
            m, u = m.float(), u.float()
        u = torch.div(m, u, out=u).mul_(-step_size)
        u = torch.view_as_complex(u) if torch.is_complex(p) else u
        wd = group["weight_decay"]
        return Stores((u,), 1 - lr * wd) if wd != 0 and group["decoupled_weight_decay"] else u

    def update_many(self, group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]],
                    snapshots: list[Any]) -> list[Tensor | Scaled | Stores | None]:
        """:meth:`update` of several parameters of ``group`` on one device (formulas above). bf16/fp16
        and complex parameters, whose rounding ``update`` mirrors, and steps kept on several
        devices, take :meth:`update` one by one."""
        out: list[Tensor | Scaled | Stores | None] = [None] * len(params)
        live = []
        for i, (p, state) in enumerate(zip(params, states)):
            if p.grad is None or "exp_avg" not in state:
                continue
            if p.dtype in _BATCHED and state["exp_avg"].dtype == p.dtype:
                live.append(i)
            else:
                out[i] = self.update(group, p, state, snapshots[i])
        steps = [states[i]["step"] for i in live]
        if not all(isinstance(s, Tensor) for s in steps) or len({s.device for s in steps}) > 1:
            for i in live:
                out[i] = self.update(group, params[i], states[i], snapshots[i])
            return out
        if live:
            for i, u in zip(live, self._rebuild(group, [params[i] for i in live], [states[i] for i in live])):
                out[i] = u
        return out

    def fusable(self, group: dict[str, Any]) -> bool:
        """Whether :meth:`fused` serves this group (decided before the step): number
        hyperparameters, CPU-counted steps (neither ``capturable`` nor ``differentiable``)."""
        return not (group["capturable"] or group["differentiable"]
                    or any(isinstance(x, Tensor) for x in (group["lr"], *group["betas"])))

    def fused(self, group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]]
              ) -> tuple[Any, tuple[Any, ...], Tensor, Tensor | None] | None:
        """The fused form of :meth:`update_many` (:mod:`monitored_optim.capture.fused`): ``(quotients, (m, v,
        eps·b), c, s)`` with d = c·m / (sqrt(v) + eps·b) per parameter and s the decoupled-decay
        factor (None without it); None where a state is missing, of another dtype, or its step
        lives elsewhere than the others'."""
        if not self.fusable(group) or not all("exp_avg" in st and st["exp_avg"].dtype == p.dtype
                                              for p, st in zip(params, states)):
            return None
        steps = [st["step"] for st in states]
        if not all(isinstance(t, Tensor) for t in steps) or len({t.device for t in steps}) > 1:
            return None
        device = params[0].device
        eps_bs, cs = _coefficients(group, states, device)
        if isinstance(cs, Tensor):  # tensor coefficients (steps on the device)
            eps_b, c = torch.stack(cast(list[Tensor], eps_bs)), cs
        else:  # Python floats: one small copy each
            eps_b, c = (torch.tensor(x, dtype=torch.float64, device=device) for x in (eps_bs, cs))
        v = "max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq"
        lr, wd = group["lr"], group["weight_decay"]
        s = torch.tensor(1 - lr * wd, dtype=torch.float64, device=device) \
            if wd != 0 and group["decoupled_weight_decay"] else None
        return quotients, ([st["exp_avg"] for st in states], [st[v] for st in states], eps_b), c, s

    def _rebuild(self, group: dict[str, Any], params: list[Tensor],
                 states: list[dict[str, Any]]) -> Sequence[Scaled | Stores]:
        eps_b, c = _coefficients(group, states, params[0].device)
        r = torch._foreach_sqrt([s["max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq"] for s in states])
        torch._foreach_add_(r, eps_b)
        torch._foreach_reciprocal_(r)
        torch._foreach_mul_(r, [s["exp_avg"] for s in states])
        factors: Sequence[float | Tensor] = c.unbind() if isinstance(c, Tensor) else c
        d = [Scaled(t, f) for t, f in zip(r, factors)]
        lr, wd = group["lr"], group["weight_decay"]
        return [Stores((x,), 1 - lr * wd) for x in d] if wd != 0 and group["decoupled_weight_decay"] else d


def _coefficients(group: dict[str, Any], states: list[dict[str, Any]],
                  device: torch.device) -> tuple[list[float] | list[Tensor], list[float] | Tensor]:
    """Per parameter, eps·b and c = -(lr / bc1)·b (b = sqrt(bc2)): Python floats where torch's step
    reads its CPU step counters as Python numbers (plain float hyperparameters, neither
    ``capturable`` nor ``differentiable``), read here with one ``tolist`` of their stack (host
    memory, no device sync); else float64 (or, like torch's tensor steps, float32) tensors on
    ``device``."""
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    step = torch.stack([s["step"] if s["step"].dim() == 0 else s["step"].reshape(()) for s in states])
    tensor_math = group["capturable"] or group["differentiable"]
    if not (tensor_math or step.device.type != "cpu" or any(isinstance(x, Tensor) for x in (lr, beta1, beta2))):
        b = [(1 - beta2**t) ** 0.5 for t in step.tolist()]
        return [eps * x for x in b], [-(lr / (1 - beta1**t)) * x for t, x in zip(step.tolist(), b)]
    if not tensor_math:
        step = step.double()  # torch's step.item() in Python doubles, without a host read
    b = (1 - beta2**step).sqrt()
    return list((eps * b).to(device).unbind()), (-(lr / (1 - beta1**step)) * b).to(device)


def quotients(m: list[Tensor], v: list[Tensor], eps_b: Tensor) -> list[Tensor]:
    """r = m / (sqrt(v) + eps·b) per parameter (``eps_b``: float64, shape (k,)), as :meth:`AdamView._rebuild`
    forms it (reciprocal, then product): the fused form's rebuild, traced by ``torch.compile``."""
    return [mi * (vi.sqrt() + e.to(vi.dtype)).reciprocal() for mi, vi, e in zip(m, v, eps_b.unbind())]

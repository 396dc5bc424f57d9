"""Lion views: lion-pytorch ``Lion`` and pytorch-optimizer ``Lion``.

Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), with ĝ the gradient
the step uses (negated under ``maximize``, plus λ·p_b under coupled decay),
momentum m, betas (β1, β2), lr γ and the decoupled-decay factor s:

    p ← s·p;   c = lerp(m_b, ĝ, 1-β1);   p ← p - γ·sign(c);   m ← lerp(m_b, ĝ, 1-β2)

Rebuild after the step, without p_b or m_b: eliminating m_b between c and the stored m gives
c·β2 = β1·m + (β2 - β1)·ĝ in exact arithmetic, so sign(c) = sign(β1·m + (β2 - β1)·ĝ) (formed in
float64), and u is ``Stores((-γ·sign(c),), s)``: the two stores p ← s·p, p ← p - γ·sign(c), which
the capture inverts in turn. The sign is exact except where c is within the roundings of m and of
ĝ - m_b of zero; ``before`` replays the step's own arithmetic on the part (c and m, without
storing them) and takes a clone of the part where any rebuilt sign differs. That check reads one
number on the host: done for CPU parameters; elsewhere the view takes the clone.

Per implementation (the step each view is registered for):

* lion-pytorch 0.2.5 ``Lion`` (``lion_pytorch/lion_pytorch.py``, ``update_fn``):
  c = fl(fl(β1·m_b) + (1-β1)·g), m = fl(fl(β2·m_b) + (1-β2)·g), s = 1 - γ·λ; its decoupled-decay
  option divides λ by the initial lr kept on the optimizer, out of a view's sight, so groups with
  λ ≠ 0 are cloned, as are complex parameters (``sgn_`` of a complex number is not a sign per
  component).
* pytorch-optimizer 4.1 ``Lion`` (``pytorch_optimizer/optimizer/lion.py``, ``_step_per_param`` /
  ``_step_foreach``): lerps as above; the step rewrites ``p.grad`` into ĝ (negated under the
  optimizer's ``maximize``, which is not in the group, then + λ·p_b without ``weight_decouple``),
  so the rebuild reads ĝ from ``p.grad`` and ``before`` checks both signs of g;
  s = 1 - λ·(1 if ``fixed_decay`` else γ); ``use_gc``, ``adanorm`` and ``cautious`` are cloned.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._shared import KAPPA_MAX, blocks, like, real, to_scalar
from .clone import Cloned, Scaled, Stores
from .view import View


class LionView(View):
    """Shared rebuild of the Lion views (module docstring); subclasses say how their step stores.

    Subclass hooks: :meth:`covers` (whether the group's options are rebuilt), :meth:`factor` (s),
    :meth:`moments` (c and m as the step computes them, from m_b and ĝ) and :meth:`grads_before`
    (each ĝ the step may use, read before it; after it, ``p.grad`` is ĝ).
    """

    elementwise = True

    def covers(self, group: dict[str, Any], p: Tensor) -> bool:
        return True

    def factor(self, group: dict[str, Any]) -> float | Tensor:
        return 1.0

    def moments(self, m_b: Tensor, g: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
        """(c, m) as the step forms them: lerps of m_b towards ĝ by 1-β1 and 1-β2."""
        return m_b.lerp(g, 1 - beta1), m_b.lerp(g, 1 - beta2)

    def grads_before(self, group: dict[str, Any], p: Tensor) -> list[Tensor]:
        assert p.grad is not None  # asked only of a parameter with a grad (before() checks it)
        return [p.grad]

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | None:
        if p.grad is None:
            return None
        s = self.factor(group)
        if not (self.covers(group, p) and p.device.type == "cpu" and not p.grad.is_sparse
                and abs(float(s)) * KAPPA_MAX >= 1.0 and self._signs_rebuilt(group, p, state)):
            return Cloned.of(p)
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Stores | None:
        if p.grad is None or "exp_avg" not in state:
            return None
        beta1, beta2 = group["betas"]
        sign = _rebuilt_sign(real(state["exp_avg"]), real(p.grad), beta1, beta2)
        sign = sign.to(real(p.detach()).dtype)
        return Stores((Scaled(like(sign, p), -to_scalar(group["lr"])),), self.factor(group))

    def _signs_rebuilt(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> bool:
        """Whether :meth:`update` will give the sign the step takes, for every ĝ it may use."""
        beta1, beta2 = group["betas"]
        for g in self.grads_before(group, p):
            for m_b, g_k in blocks(real(state["exp_avg"]) if "exp_avg" in state else None, real(g)):
                assert g_k is not None  # a block of g, which is a tensor
                m_b = torch.zeros_like(g_k) if m_b is None else m_b
                c, m = self.moments(m_b, g_k, beta1, beta2)
                if not torch.equal(c.sign(), _rebuilt_sign(m, g_k, beta1, beta2).to(c.dtype)):
                    return False
        return True


def _rebuilt_sign(m: Tensor, g: Tensor, beta1: float, beta2: float) -> Tensor:
    """sign(β1·m + (β2 - β1)·ĝ) in float64: the sign of c, from the stored m and ĝ."""
    return (m.double() * beta1).add_(g.double(), alpha=beta2 - beta1).sign_()


class LucidrainsLionView(LionView):
    """View for lion-pytorch's ``Lion`` (module docstring)."""

    def covers(self, group: dict[str, Any], p: Tensor) -> bool:
        return group["weight_decay"] == 0 and not p.is_complex()

    def moments(self, m_b: Tensor, g: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
        return m_b.mul(beta1).add_(g, alpha=1 - beta1), m_b.mul(beta2).add_(g, alpha=1 - beta2)


class OptimizerLionView(LionView):
    """View for pytorch-optimizer's ``Lion`` (module docstring)."""

    def covers(self, group: dict[str, Any], p: Tensor) -> bool:
        return not (group.get("use_gc") or group.get("adanorm") or group.get("cautious"))

    def factor(self, group: dict[str, Any]) -> float | Tensor:
        wd = group["weight_decay"]
        if wd == 0 or not group["weight_decouple"]:
            return 1.0
        return 1.0 - wd * (1.0 if group["fixed_decay"] else to_scalar(group["lr"]))

    def grads_before(self, group: dict[str, Any], p: Tensor) -> list[Tensor]:
        coupled = group["weight_decay"] > 0 and not group["weight_decouple"]
        grad = p.grad
        assert grad is not None  # asked only of a parameter with a grad (before() checks it)
        return [g.add(p.detach(), alpha=group["weight_decay"]) if coupled else g for g in (grad, -grad)]

    def keeps_grad(self, group: dict[str, Any]) -> bool:
        """False under coupled weight decay, which the step adds into ``p.grad``."""
        return not (group["weight_decay"] > 0 and not group["weight_decouple"])

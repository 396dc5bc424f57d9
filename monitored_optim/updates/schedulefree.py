"""Schedule-free views (schedulefree 1.4: ``AdamWScheduleFree``, ``SGDScheduleFree``, ``RAdamScheduleFree``).

Schedule-free training (Defazio et al., 2024, "The Road Less Scheduled") in train mode stores
y = p and z = ``state["z"]``. With k the group's count before the step, the step's lr γ (warmup
schedule, or RAdam's rectification), w = ckp1 = (k+1)^r·lr_max^q / Σ of those weights, and β the
momentum (β1, or SGD's ``momentum``):

    ĝ = g / (sqrt(v/bc2) + eps) (AdamW; RAdam once rectified; SGD: g), plus λ·y_b (decay),
        written into ``p.grad``
    y ← lerp(y_b, z_b, w);   y ← y + γ(β(1-w) - 1)·ĝ;   z ← z_b - γ·ĝ

Rebuild after the step, from y_a, z_a, ``p.grad`` = ĝ and the group's post-step scalars
(``scheduled_lr``, ``lr_max``, ``weight_sum``, k): z_b = z_a + γ·ĝ, y_l = y_a - γ(β(1-w)-1)·ĝ,
y_b = (y_l - w·z_b)/(1-w) in float64, and u = y_a - y_b in p's dtype.

On a parameter's first step z is created as a copy of y (z_b = y_b, so the lerp leaves y as it was):
y_b = z_b = z_a + γ·ĝ, whatever w is. The same holds while the group's weight sum is 0 (every step so
far had γ = 0, as in RAdam's silent first steps: z never moved): the view's snapshot says so (:data:`FRESH`).

The lerp contracts y by 1-w in y's own precision, so p_b is not recoverable from the state after the
step: about a fraction w of the elements come back one spacing off, which weighs where the update is a
few spacings of y (SGD's raw gradient steps; RAdam's). ``before`` therefore replays the step on the
part (the optimizer's own operations, a block of the part at a time), which gives the stored change
itself, and keeps the rebuild only where it misses that change by at most ``MISS`` of its spread
(‖miss‖ ≤ MISS·‖u - mean(u)‖, a bound on every figure; one number read on the host). Elsewhere
(and for w > 1/2 past a parameter's first step, where the rebuild is not tried) the snapshot is the
replayed change's sums, :class:`~monitored_optim.updates.clone.Summed`: three numbers, no copy.
Off the CPU, and for complex parameters, the view takes a clone.
Source: schedulefree 1.4.1, ``adamw_schedulefree.py``, ``sgd_schedulefree.py``,
``radam_schedulefree.py`` (``step``, single-tensor and foreach paths alike).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..stats import MISS
from ._shared import blocks
from .clone import Cloned, Summed
from .view import View

FRESH = "z_b = y_b"
"""The snapshot of a parameter's first step, where the step creates z as a copy of y."""




class ScheduleFreeView(View):
    """Shared rebuild of the schedule-free views (module docstring); subclasses give the step's lr,
    its momentum and its normalized gradient."""

    elementwise = True
    checks_store = True

    def lr(self, group: dict[str, Any]) -> float:
        """γ of the coming step (warmup: γ·(k+1)/warmup_steps while k < warmup_steps)."""
        k, warmup = group["k"], group["warmup_steps"]
        return group["lr"] * ((k + 1) / warmup if k < warmup else 1.0)

    def beta(self, group: dict[str, Any]) -> float:
        return group["betas"][0]

    def normalized(self, group: dict[str, Any], y: Tensor, g: Tensor, v: Tensor | None) -> Tensor:
        """ĝ of the coming step, as a new tensor (the step writes it into ``p.grad``), from the values
        y of p, its grad g and second moment v (None before the parameter's first step)."""
        return _adam_normalized(group, y, g, v, group["k"] + 1)

    def keeps_grad(self, group: dict[str, Any]) -> bool:
        """False: the step divides ``p.grad`` in place (and adds the decay into it)."""
        return False

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | Summed | str | None:
        if p.grad is None:
            return None
        if p.device.type != "cpu" or p.is_complex():
            return Cloned.of(p)
        lr = self.lr(group)
        lr_max = max(lr, group["lr_max"])
        weight = _weight(group, group["k"], lr_max)
        w = _ratio(weight, group["weight_sum"] + weight)
        fresh = "z" not in state or group["weight_sum"] == 0
        if w == 0 and lr == 0:  # y ← y + 0·(z - y) + 0·ĝ: the rebuild gives y_b = y_a, exactly
            return FRESH if fresh else None
        return self.replayed(group, p, state, w, lr, fresh, rebuild=fresh or w <= 0.5)

    def replayed(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], w: float, lr: float, fresh: bool,
                 rebuild: bool = True) -> Summed | str | None:
        """The snapshot of ``p`` from a replay of the step, a block at a time (``blocks``).

        Returns:
            :data:`FRESH` or None where ``rebuild`` and the rebuild misses the replayed stored change
            by at most :data:`~monitored_optim.stats.MISS` of its spread (one host read), else the change's
            :class:`~monitored_optim.updates.clone.Summed` (float64 sums in the step's own arithmetic).
        """
        alpha = lr * (self.beta(group) * (1 - w) - 1)
        sums = p.new_zeros(4, dtype=torch.float64)  # (c, Σ(u - c), Σ(u - c)², ‖miss‖²)
        for i, (y, z, g, v) in enumerate(blocks(p.detach(), state.get("z"), p.grad, state.get("exp_avg_sq"))):
            assert y is not None and g is not None  # blocks of p and of its grad (before() checked it)
            m, z = y.numel(), y if z is None else z
            if i == 0:  # buffers of the first (largest) block, reused block after block: no heap churn
                y_a, z_a, narrow = (y.new_empty(m) for _ in range(3))
                u, wide = _wide(m)
            g = self.normalized(group, y, g, v)
            ya = torch.lerp(y, z, w, out=y_a[:m]).add_(g, alpha=alpha)
            du = u[:m].copy_(ya).sub_(y)  # the stored change, exact in float64
            if i == 0:
                sums[0] = du.mean()
            sums[1] += du.sub_(sums[0]).sum()
            sums[2] += du.square_().sum()
            if rebuild:
                d = _rebuilt(ya, torch.sub(z, g, alpha=lr, out=z_a[:m]), g, w, lr, alpha, fresh,
                             narrow[:m], (u[:m], wide[:m]))
                sums[3] += wide[:m].copy_(ya.sub_(d)).sub_(y).square_().sum()  # fl(y_a - d) - y_b
        n = p.numel()
        if n == 0:
            return FRESH if fresh else None
        if rebuild and bool(sums[3].sqrt() <= MISS * (sums[2] - sums[1].square() / n).clamp(min=0).sqrt()):
            return FRESH if fresh else None
        return Summed(torch.stack([sums[0], sums[1], sums[2].sqrt()]), n)

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | Summed | None:
        if isinstance(snapshot, Summed):
            return snapshot
        if p.grad is None or "z" not in state:
            return None
        lr, k = group["scheduled_lr"], group["k"] - 1
        w = _ratio(_weight(group, k, group["lr_max"]), group["weight_sum"])
        alpha = lr * (self.beta(group) * (1 - w) - 1)
        u = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        for i, (y, z, g, out) in enumerate(blocks(p.detach(), state["z"], p.grad, u)):
            assert y is not None and z is not None and g is not None and out is not None  # none of the four is None
            if i == 0:  # float64 temporaries of a block, not of the part, reused block after block
                wide = _wide(y.numel())
            _rebuilt(y, z, g, w, lr, alpha, snapshot == FRESH, out,
                     (wide[0][:y.numel()], wide[1][:y.numel()]))
        return u


class AdamWScheduleFreeView(ScheduleFreeView):
    """View for schedulefree's ``AdamWScheduleFree``."""


class SGDScheduleFreeView(ScheduleFreeView):
    """View for schedulefree's ``SGDScheduleFree`` (ĝ = g + λ·y_b, β = ``momentum``)."""

    def beta(self, group: dict[str, Any]) -> float:
        return group["momentum"]

    def normalized(self, group: dict[str, Any], y: Tensor, g: Tensor, v: Tensor | None) -> Tensor:
        return _decayed(group, y, g.clone())

    def keeps_grad(self, group: dict[str, Any]) -> bool:
        """False under weight decay, which the step adds into ``p.grad``."""
        return group["weight_decay"] == 0


class RAdamScheduleFreeView(ScheduleFreeView):
    """View for schedulefree's ``RAdamScheduleFree`` (γ = lr·rect; ĝ normalized once ρ_t > 4)."""

    def lr(self, group: dict[str, Any]) -> float:
        return group["lr"] * _rectification(group, group["k"] + 1)[0]

    def silent(self, group: dict[str, Any]) -> bool:
        """True after a step of the silent phase (ρ_t <= 4 with ``silent_sgd_phase``: γ = lr·0) of a
        group whose lr is not 0 (a zero lr is the user's, and health tells of it)."""
        return group["k"] > 0 and bool(group["lr"] != 0) and _rectification(group, group["k"])[0] == 0

    def normalized(self, group: dict[str, Any], y: Tensor, g: Tensor, v: Tensor | None) -> Tensor:
        step = group["k"] + 1
        if _rectification(group, step)[1]:
            return _adam_normalized(group, y, g, v, step)
        return _decayed(group, y, g.clone())


def _weight(group: dict[str, Any], k: int, lr_max: float) -> float:
    """The averaging weight of the step that starts at count k: (k+1)^r · lr_max^q."""
    return ((k + 1) ** group["r"]) * (lr_max ** group["weight_lr_power"])


def _ratio(weight: float, total: float) -> float:
    """ckp1 = weight / total, 0 where total is 0 (as the step catches ZeroDivisionError)."""
    return weight / total if total != 0 else 0


def _decayed(group: dict[str, Any], y: Tensor, g: Tensor) -> Tensor:
    """``g`` (a new tensor) plus λ·y where the group decays, as the step adds it."""
    return g.add_(y, alpha=group["weight_decay"]) if group["weight_decay"] != 0 else g


def _adam_normalized(group: dict[str, Any], y: Tensor, g: Tensor, v: Tensor | None, step: int) -> Tensor:
    """g / (sqrt(v'/bc2) + eps) (+ λ·y), v' the second moment the step will store (from zeros where
    ``v`` is None: a parameter's first step), bc2 = 1 - β2^step."""
    beta2 = group["betas"][1]
    v = v.mul(beta2) if v is not None else torch.zeros_like(g)
    v.addcmul_(g, g, value=1 - beta2)
    return _decayed(group, y, g.div(v.div_(1 - beta2**step).sqrt_().add_(group["eps"])))


def _rectification(group: dict[str, Any], step: int) -> tuple[float, bool]:
    """RAdam's (rect, ρ_t > 4) at ``step``, in the step's own arithmetic."""
    beta2 = group["betas"][1]
    beta2_t = beta2**step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2_t / (1 - beta2_t)
    if rho_t > 4.0:
        return ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5, True
    return float(not group["silent_sgd_phase"]), False


def _wide(m: int) -> tuple[Tensor, Tensor]:
    """Two float64 buffers of ``m`` elements: the temporaries of :func:`_rebuilt` for a block of ``m``."""
    return torch.empty(m, dtype=torch.float64), torch.empty(m, dtype=torch.float64)


def _rebuilt(y_a: Tensor, z_a: Tensor, g: Tensor, w: float, lr: float, alpha: float, fresh: bool,
             out: Tensor, wide: tuple[Tensor, Tensor]) -> Tensor:
    """u = y_a - y_b from y_a, z_a and ĝ (module docstring), into ``out`` (a tensor of y's size and
    dtype): z_b and y_l in y's dtype, as the step's stores were, y_b in float64 (y_b = z_b where
    ``fresh``), its temporaries in ``wide`` (two float64 buffers of y's size, :func:`_wide`)."""
    z_b = wide[0].copy_(torch.add(z_a, g, alpha=lr, out=out))
    if fresh:
        y_b, spare = z_b, wide[1]
    else:
        y_l = torch.sub(y_a, g, alpha=alpha, out=out)
        y_b, spare = wide[1].copy_(y_l).sub_(z_b.mul_(w)).div_(1 - w), z_b
    u = torch.sub(spare.copy_(y_a), y_b, out=y_b)  # y_a widened exactly, into a buffer (not a cast's temporary)
    return out.copy_(u)

"""The guard: a step whose grads hold a NaN or an Inf, or spike, is not taken.

Before the base step the guard judges the grad of every monitored parameter; where one fails, the
base step is not called at all, as torch's ``GradScaler`` does with an inf or NaN it finds, so the
parameters, the state, its step counts and ``state_dict()`` stay those of the optimizer that never
took the step (never an update multiplied by zero: 0 x NaN is NaN). What it judges:

* ``nonfinite``: each grad's L2 norm (float32, or float64 for a float64 grad), NaN or inf where an
  element is NaN or ±inf (and where it is not finite, the grad's elements themselves, so that a
  finite grad whose norm overflows is not taken for a poisoned one);
* ``spikes``: log10 of the same norms, judged at every step by the
  ``health/spikes`` rule (:class:`~monitored_optim.families.spikes.SpikeRule`) against the steps
  the guard let through; the values of a skipped step never enter its history, and nothing is
  judged before a parameter has :data:`~monitored_optim.families.spikes.MIN_HISTORY` values. The
  grads of a fused optimizer's ``GradScaler`` step are still scaled: their norms are divided by
  the scale.

Under ``torch.distributed`` each rank judges the grads it holds (a shard of a layer, under FSDP and
ZeRO) and the verdict is one ``all_reduce`` (MAX) of two flags over the world, so every rank skips
the same step and none waits on a collective another skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import distributed
from .alerts import Voice
from .families.spikes import SpikeRule


class Guard:
    """Judges each step's grads before the base step and keeps count of the steps it skipped.

    Args:
        kinds: what it judges, a subset of :data:`~monitored_optim.config.GUARDS`.
        budget: steps it may skip in a row; one more is a ``stalled`` event that asks to stop.
        voice: the run's :class:`~monitored_optim.alerts.Voice` (events ``skipped``, ``nonfinite``,
            ``spikes``, ``stalled``).

    Attributes:
        skipped: steps skipped so far (``guard/skipped``).
        streak: steps skipped in a row up to the last one judged.
        last_skipped: whether it skipped the last step it judged.
    """

    def __init__(self, kinds: frozenset[str], budget: int, voice: Voice) -> None:
        self.kinds, self.budget, self.voice = kinds, budget, voice
        self.rule = SpikeRule(1) if "spikes" in kinds else None
        self.skipped = 0
        self.streak = 0
        self.last_skipped = False

    def ahead(self, params: list[tuple[str, Tensor]], args: tuple[Any, ...], kwargs: dict[str, Any],
              closure: Callable[[], Any] | None, scale: Tensor | None, step: int
              ) -> tuple[bool, tuple[Any, ...], dict[str, Any], Any]:
        """Judge optimizer step ``step`` before it is taken: run ``closure``, the one its call passes (None:
        none; :func:`ran_first`), then whether to skip it (:meth:`skips`) by the grads of ``params`` (name,
        parameter). Returns the verdict, the call's arguments and the closure's loss (None: no closure)."""
        args, kwargs, loss = ran_first(args, kwargs, closure)
        named = [(n, p.grad) for n, p in params if p.grad is not None]
        return self.skips(named, scale, step), args, kwargs, loss

    def skips(self, named: list[tuple[str, Tensor]], scale: Tensor | None, step: int) -> bool:
        """Whether to skip optimizer step ``step`` whose grads are ``named`` (name, grad), scaled by
        ``scale`` (a fused ``GradScaler`` step's, else None); counts it and tells its events.

        One host sync; under ``torch.distributed`` also one ``all_reduce`` of two flags."""
        present = [(name, local) for name, g in named if (local := _local(g)).numel()]  # an empty shard holds nothing
        names, grads = tuple(name for name, _ in present), [g for _, g in present]
        bad, x = self._measure(grads, scale)
        nonfinite = bad.tolist() if "nonfinite" in self.kinds else [False] * len(names)
        spiking = self.rule.judge(names, x)[:, 0].tolist() if self.rule is not None else [False] * len(names)
        verdict = [any(nonfinite), any(spiking)]
        if distributed.initialized() and dist.get_world_size() > 1:
            flags = torch.tensor(verdict, dtype=torch.float32, device=distributed.collective_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            verdict = [bool(v) for v in flags.tolist()]
        self.last_skipped = any(verdict)
        if not self.last_skipped:
            self.streak = 0
            if self.rule is not None:
                self.rule.admit(x, x.isfinite())
            return False
        self.skipped += 1
        self.streak += 1
        self._tell(step, names, nonfinite, spiking, x, verdict)
        return True

    def _measure(self, grads: list[Tensor], scale: Tensor | None) -> tuple[Tensor, Tensor]:
        """Per grad, whether it holds a NaN or an Inf (bool) and log10 of its L2 norm (float64, a
        column; NaN where the norm is 0), read to the host in one copy.

        One pass: the L2 norm (in float32, or float64 for a float64 grad) is NaN or inf where the grad
        holds a NaN or an Inf; where it is not finite, the grad itself is asked (``isfinite``), so
        that a finite grad whose norm overflows is not taken for a poisoned one."""
        if not grads:
            return torch.zeros(0, dtype=torch.bool), torch.zeros((0, 1), dtype=torch.float64)
        device = grads[0].device
        low = [g for g in grads if g.dtype != torch.float64]  # fp16 and bf16 norms taken in float32
        high = [g for g in grads if g.dtype == torch.float64]
        wide = iter(torch._foreach_norm(low, 2, dtype=torch.float32) if low else ())
        doubles = iter(torch._foreach_norm(high, 2) if high else ())
        norms = torch.stack([next(doubles if g.dtype == torch.float64 else wide).to(device, torch.float64)
                             for g in grads])
        if scale is not None:
            norms = norms / scale.to(device, torch.float64)
        host = norms.cpu()
        bad = ~host.isfinite()
        for i in bad.nonzero().flatten().tolist():  # only where a norm is not finite (usually nowhere)
            bad[i] = not bool(grads[i].isfinite().all())
        x = torch.where(host > 0, host.log10(), math.nan).unsqueeze(1)
        return bad, x

    def _tell(self, step: int, names: tuple[str, ...], nonfinite: list[bool], spiking: list[bool], x: Tensor,
              verdict: list[bool]) -> None:
        """The events of skipped step ``step``, from the verdict reduced over the ranks (so every rank
        has the same events, and a stop one asks for is every rank's), naming the layers this rank saw;
        and a stall past the budget."""
        bad = [f"{name} (grad)" for name, hit in zip(names, nonfinite) if hit] or ["a grad on another rank"]
        high = [f"{name} (grad_norm 10^{v:.2f})" for name, hit, v in zip(names, spiking, x[:, 0].tolist()) if hit
                ] or ["a grad on another rank"]
        found = [layers for layers, hit in zip((bad, high), verdict) if hit]  # the verdict: the same on every rank
        self.voice.event("skipped", step, [layer for layers in found for layer in layers])
        if verdict[0]:
            self.voice.event("nonfinite", step, bad)
        if verdict[1]:
            self.voice.event("spikes", step, high)
        if self.streak > self.budget:
            self.voice.event("stalled", step, [f"{self.streak} steps skipped in a row"], stop=True)

    def state_dict(self) -> dict[str, Any]:
        """Its counts and the spike rule's history, to resume with (:meth:`load_state_dict`)."""
        return {"skipped": self.skipped, "streak": self.streak,
                "rule": self.rule.state_dict() if self.rule is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`state_dict` gave."""
        self.skipped, self.streak = int(state.get("skipped", 0)), int(state.get("streak", 0))
        if self.rule is not None and state.get("rule") is not None:
            self.rule.load_state_dict(state["rule"])


def ran_first(args: tuple[Any, ...], kwargs: dict[str, Any], closure: Callable[[], Any] | None
              ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """Run ``closure``, the one a ``step()`` call passes (its ``closure`` keyword, else its first
    argument; None: none), so that its grads can be judged before the base step; returns the call's
    arguments with the closure replaced by one whose first call gives that loss (a later call, LBFGS's,
    runs the closure again), and the loss (None: no closure).

    The closure runs under ``torch.enable_grad()``, as torch's optimizers call it."""
    if closure is None:
        return args, kwargs, None
    with torch.enable_grad():
        loss = closure()
    first = True

    def again() -> Any:
        nonlocal first
        if first:
            first = False
            return loss
        return closure()

    if "closure" in kwargs:
        return args, {**kwargs, "closure": again}, loss
    return (again, *args[1:]), kwargs, loss


def _local(grad: Tensor) -> Tensor:
    """The elements of ``grad`` this process holds: a DTensor's local shard, a sparse grad's values."""
    if hasattr(grad, "to_local"):
        return grad.to_local()
    if grad.is_sparse:
        return grad.coalesce().values()
    return grad

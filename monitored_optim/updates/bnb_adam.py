"""bitsandbytes 32-bit Adam / AdamW view (bitsandbytes 0.50, CPU kernel).

bitsandbytes' ``Optimizer2State.update_step`` with 32-bit state (``state1`` m, ``state2`` v, a
Python int ``step`` t already incremented) runs ``optimizer_update_32bit``; its CPU kernel
(``bitsandbytes/backends/cpu/ops.py``, ``_optimizer_update_32bit_cpu``, the ``"adam"`` branch),
with c1 = 1 - β1^t, c2 = sqrt(1 - β2^t) (Python floats) and s = 1 - lr·λ:

    m ← β1·m + (1-β1)·g;   v ← β2·v + (1-β2)·g²
    p ← s·p  (λ > 0);   p ← p + (-lr·c2/c1) · m / (sqrt(v) + eps·c2)

Rebuild after the step: r = m / (sqrt(v) + eps·c2) from the stored m, v and t, with the kernel's own
operations, and u = ``Stores((Scaled(r, -lr·c2/c1),), s)``, the two stores the capture inverts in turn.
Adam and AdamW run the same kernel (they differ only in their default λ).

bitsandbytes keeps more on the optimizer than in the group: all its optimizers share one ``step``
(``Optimizer8bit.step``, for which this view is registered) and pick their arithmetic from instance
attributes, so the view rebuilds only what the state and the group show to be this branch, and
elsewhere (every other bitsandbytes optimizer: 8-bit, paged, Lion, LAMB, ...) measures the parameter in
its turn of the step (:mod:`monitored_optim.updates.turns`: the step calls ``update_step`` once per
parameter, so a copy of that parameter alone is held while it is updated). Before a parameter's
first step its state is empty, so the view bound to the optimizer (:meth:`BnbAdamView.bound`) reads
the instance's ``optimizer_name`` and ``args`` as they are at that step: Adam's kernel with
``optim_bits=32`` and no ``max_unorm`` creates 32-bit state, and that first step is rebuilt like
any other. The turn measures it on a first step otherwise (8-bit, whose parameters below
``min_8bit_size`` get 32-bit state and are rebuilt from their second step), with 8-bit state, a
1-state optimizer (no ``state2``), three betas (AdEMAMix), ``max_unorm`` (a ``unorm_vec``), per-parameter overrides of
the ``GlobalOptimManager``, a decay factor |s| < 1/2, and off the CPU (the CUDA kernel applies the
decay after the update, in its own rounding, which this view does not mirror).
Source: Dettmers et al. (2022) "8-bit Optimizers via Block-wise Quantization", bitsandbytes
``optim/optimizer.py`` (``Optimizer2State``) and ``backends/cpu/ops.py``.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any, ContextManager

import torch
from torch import Tensor

from ._shared import KAPPA_MAX
from .clone import Cloned, Scaled, Stores, Summed
from .turns import Method, TurnView
from .view import View

TURN = Method("update_step", 1)
"""``Optimizer8bit.step`` calls ``self.update_step(group, p, gindex, pindex)`` once per parameter with a grad."""


class BnbAdamView(View):
    """State-aware view for bitsandbytes' ``Adam`` / ``AdamW`` with 32-bit state (module docstring)."""

    elementwise = True

    def __init__(self, optimizer: Any = None) -> None:
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)
        """The optimizer this view is bound to (:meth:`bound`), held weakly; None for the registered view."""
        self.turned = TurnView(TURN) if optimizer is None else TurnView(TURN).bound(optimizer)
        """Where this view cannot rebuild a parameter's update, the turn view measures it (:mod:`.turns`)."""

    def stepping(self) -> ContextManager[None]:
        return self.turned.stepping()

    def bound(self, optimizer: Any) -> BnbAdamView:
        """This view for ``optimizer``, which it asks on each parameter's first step whether that step
        creates 32-bit Adam state (:attr:`adam32`)."""
        return BnbAdamView(optimizer)

    @property
    def adam32(self) -> bool:
        """Whether the bound optimizer creates 32-bit Adam state (no ``unorm_vec``) on a first step,
        from its ``optimizer_name`` and ``args`` as they are now (``args`` may be changed after the
        optimizer is built: ``init_state`` reads it on the first step); False for an unbound view."""
        optimizer = None if self._optimizer is None else self._optimizer()
        args = getattr(optimizer, "args", None)
        return (getattr(optimizer, "optimizer_name", None) == "adam"
                and getattr(args, "optim_bits", None) == 32 and getattr(args, "max_unorm", None) == 0.0)

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned | Summed | None:
        if p.grad is None:
            return None
        s = 1 - group["lr"] * group["weight_decay"]
        two_betas = "t_alpha" in group and len(group["betas"]) == 2
        if not state:  # a first step: the state it creates is known from the bound optimizer only
            adam = two_betas and self.adam32
        else:
            adam = (two_betas and "unorm_vec" not in state
                    and isinstance(state.get("state1"), Tensor) and state["state1"].dtype == torch.float32
                    and isinstance(state.get("state2"), Tensor) and state["state2"].shape == p.shape)
        if not (adam and p.device.type == "cpu" and abs(s) * KAPPA_MAX >= 1.0 and not _overridden()):
            return self.turned.before(group, p, state)
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any
               ) -> Stores | Summed | None:
        if isinstance(snapshot, Summed):  # measured in its turn of the step
            return self.turned.update(group, p, state, snapshot)
        if p.grad is None or "state2" not in state:
            return None
        lr, (beta1, beta2), eps, t = group["lr"], group["betas"], group["eps"], state["step"]
        c1, c2 = 1.0 - beta1**t, math.sqrt(1.0 - beta2**t)
        r = state["state1"] / (state["state2"].sqrt() + eps * c2)
        wd = group["weight_decay"]
        return Stores((Scaled(r, -lr * c2 / c1),), 1.0 - lr * wd if wd > 0.0 else 1.0)


def _overridden() -> bool:
    """Whether bitsandbytes' ``GlobalOptimManager`` holds per-parameter config overrides (its module
    is imported wherever a bitsandbytes optimizer exists; it is not imported here)."""
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    manager = getattr(module, "GlobalOptimManager", None)
    found = getattr(manager, "_instance", None)
    return found is not None and bool(found.pid2config or found.index2config or found.module_weight_config_triple)

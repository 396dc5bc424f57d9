"""Update views: per optimizer family, how to obtain u = p_after - p_before for one parameter.

A view is a :class:`View` (``view.py``): small methods of ``(group, p, state)`` with no hidden state.

* ``before(group, p, state) -> snapshot``: called just before the base ``step()`` on logging
  steps; keeps only what the rebuild needs (default: nothing). A view that cannot be exact for this
  parameter returns :class:`~monitored_optim.updates.clone.Cloned` instead.
* ``update(group, p, state, snapshot) -> Tensor | Scaled | None`` (required): called after the step;
  the update u with ``p``'s shape (a temporary the caller drops after reducing it), a
  :class:`~monitored_optim.updates.clone.Scaled` buffer when u is a multiple of one, a
  :class:`~monitored_optim.updates.clone.Stores` ``(adds, s)`` when the step stores p several
  times (s·p under decoupled weight decay, then each d of ``adds``), a
  :class:`~monitored_optim.updates.clone.Rows` whose slices the capture asks for one at a time (a
  large parameter whose view is not element-wise), the :class:`~monitored_optim.updates.clone.Summed`
  its ``before`` kept (the sums of the step replayed, where u cannot be rebuilt), or ``None``
  when the step left ``p`` exactly unchanged (torch optimizers skip parameters whose grad is ``None``).
* ``update_many(group, params, states, snapshots) -> list``: ``update`` of several parameters of one
  group and device at once (default: one by one; ``torch._foreach_*`` ops where a view batches them).
* ``bound(optimizer) -> View``: the view for one optimizer instance, asked once when the monitor
  binds to it (default: the view itself);
* ``elementwise`` (default False): the view may be handed slices of a parameter (parts, shards);
  ``keeps_grad(group)`` (default True), ``fusable(group)`` (default False) and ``fused(group, params,
  states)`` (default None): what the compiled capture may do (``monitored_optim/capture/fused.py``).

A view is chosen by the optimizer's ``step`` function, never by class name alone: a subclass
that overrides ``step`` gets the clone fallback, whose figures are true for any optimizer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from .adadelta import AdadeltaView
from .adafactor import AdafactorView
from .adagrad import AdagradView
from .adam import AdamView
from .adamax import AdamaxView
from .asgd import AsgdView
from .clone import CLONE, Cloned, Rows, Scaled, Stores, Summed
from .muon import MuonView
from .nadam import NAdamView
from .radam import RAdamView
from .rmsprop import RMSpropView
from .rprop import RpropView
from .sgd import SgdView
from . import thirdparty
from .sparse_adam import SparseAdamView
from .view import View, adopt


_REGISTRY: dict[type[torch.optim.Optimizer], View] = {
    torch.optim.SGD: SgdView(),
    torch.optim.Adam: AdamView(),
    torch.optim.Adamax: AdamaxView(),
    torch.optim.Adagrad: AdagradView(),
    torch.optim.Adadelta: AdadeltaView(),
    torch.optim.RMSprop: RMSpropView(),
    torch.optim.Rprop: RpropView(),
    torch.optim.ASGD: AsgdView(),
    torch.optim.NAdam: NAdamView(),
    torch.optim.RAdam: RAdamView(),
    torch.optim.SparseAdam: SparseAdamView(),
    torch.optim.Adafactor: AdafactorView(),
    **({torch.optim.Muon: MuonView()} if hasattr(torch.optim, "Muon") else {}),  # torch >= 2.9
}


def rebuild(view: View, group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]],
            snapshots: list[Any]) -> list[Tensor | Scaled | None]:
    """``view.update`` of each parameter of ``params`` (all of ``group``, one device), through the
    view's ``update_many``.

    Returns:
        One entry per parameter, in order: u as a tensor of the parameter's shape (float32 for
        bf16/fp16), a :class:`Scaled` tensor, or ``None`` where the step left it unchanged.

    It raises whatever the view raises; the built-in views raise nothing for states torch itself
    accepts.
    """
    return view.update_many(group, params, states, snapshots)


def raw_step(cls: type[torch.optim.Optimizer]) -> Callable[..., Any]:
    """``cls.step`` without torch's hook wrappers (``Optimizer.profile_hook_step``, marked ``hooked``).

    torch wraps ``type(opt).step`` the first time an instance is built; the wrapper runs the
    optimizer step hooks. Unwrapping gives the function that does the arithmetic, which is what a
    view is written for and what a monitored step calls so that hooks run exactly once.
    """
    fn: Any = cls.step
    while getattr(fn, "hooked", False):
        fn = fn.__wrapped__
    return fn


def view_for(cls: type[torch.optim.Optimizer]) -> View:
    """The state-aware view whose optimizer has exactly ``cls``'s step function, else the clone view.

    Example: ``view_for(torch.optim.AdamW)`` is Adam's view (AdamW inherits ``Adam.step``); a
    subclass of Adam that overrides ``step`` gets :data:`~monitored_optim.updates.clone.CLONE`.
    Third-party optimizers with a view in ``monitored_optim.updates.thirdparty`` are registered
    here, the first time one of them (or a subclass) is asked for.
    """
    for base, view in thirdparty.views_in(cls):
        if base not in _REGISTRY:  # first use of a third-party optimizer (a view registered for it stays)
            register(base, view)
    fn = raw_step(cls)
    for base, view in _REGISTRY.items():
        if raw_step(base) is fn:
            return view
    return CLONE


def register(optimizer_cls: type[torch.optim.Optimizer], view: Any) -> None:
    """Use ``view`` for ``optimizer_cls`` (and subclasses that keep its ``step``) from now on.

    For a third-party optimizer that keeps the buffers its update can be rebuilt from. ``view`` is a
    :class:`View`, or any object with ``before`` and ``update`` methods, given :class:`View`'s
    defaults for what it lacks (``elementwise`` False, ...). Check a new view with
    ``MonitorConfig(verify=True)``, which compares it with a clone on every logging step. Affects
    optimizers built after the call.

    Raises:
        TypeError: ``optimizer_cls`` is not an optimizer class, or ``view`` lacks ``before``/``update``.
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"register() expects a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
    _REGISTRY[optimizer_cls] = adopt(view)
    _REGISTRY.update({cls: _REGISTRY.pop(cls) for cls in list(_REGISTRY) if cls is not optimizer_cls})


def elementwise(view: View) -> bool:
    """Whether ``view`` may be handed slices of a parameter (its :attr:`View.elementwise`)."""
    return view.elementwise


# what a user writing a view uses (the API page): the capture's rebuild, raw_step and elementwise are internals
__all__ = ["View", "register", "view_for", "CLONE", "Cloned", "Summed", "Scaled", "Stores", "Rows"]

"""The ``View`` base class: every capability an update view may declare, with its default.

A view rebuilds u = p_after - p_before of one parameter from what its optimizer keeps. Only
:meth:`View.update` is required; each other capability has a documented default that is right for
any optimizer, so a view declares only what it does better (Lightning's ``Callback`` style).
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, ContextManager, cast

from torch import Tensor


class View(abc.ABC):
    """Rebuilds one parameter's update from what the optimizer keeps.

    Attributes:
        elementwise: whether the update of an element depends only on that element of p, its grad
            and its state (and on scalars), so that the view may be handed a slice of a parameter:
            a part of a large one, reduced a part at a time, or a rank's shard under FSDP. Default
            False: the view gets whole parameters, and a shard gets a clone.

    Example::

        class SignSGDView(View):
            elementwise = True

            def update(self, group, p, state, snapshot):
                return None if p.grad is None else p.grad.sign() * -group["lr"]
    """

    elementwise: bool = False
    checks_store: bool = False
    """Whether :meth:`before` replays the step and measures the stored change its rebuild gives, so that
    the snapshot rule's rounding risk (:mod:`monitored_optim.capture.rules`) is its own to judge.
    Default False."""

    def bound(self, optimizer: Any) -> View:
        """The view for ``optimizer``, asked once when the monitor binds to it: a view whose arithmetic
        depends on settings the optimizer keeps outside its param groups returns a copy holding
        them (or a weak reference to the optimizer, where they may change later). Default: the view itself."""
        return self

    def stepping(self) -> ContextManager[None]:
        """What the base step of a logging step runs inside (after every :meth:`before`, before any
        :meth:`update`): a view that measures each parameter in its turn of the step installs its marker
        there (:mod:`monitored_optim.updates.turns`). Default: nothing (``contextlib.nullcontext()``)."""
        return contextlib.nullcontext()

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Any:
        """What to keep of ``p`` and ``state`` just before the step, on logging steps only.

        Returns:
            Any snapshot :meth:`update` reads; :class:`~monitored_optim.updates.clone.Cloned` to fall
            back to a clone of ``p`` where the view cannot be exact for it. Default: None (nothing).
        """
        return None

    @abc.abstractmethod
    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Any:
        """The update ``p_after - p_before`` of ``p``, after the step.

        Returns:
            A tensor of ``p``'s shape (a temporary the caller drops after reducing it), a
            :class:`~monitored_optim.updates.clone.Scaled`, :class:`~monitored_optim.updates.clone.Stores`
            or :class:`~monitored_optim.updates.clone.Rows` (see :mod:`monitored_optim.updates`), or
            None where the step left ``p`` exactly unchanged.
        """

    def update_many(self, group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]],
                    snapshots: list[Any]) -> list[Any]:
        """:meth:`update` of several parameters of ``group`` on one device, in order.

        Default: :meth:`update` of each; a view overrides it to batch them (``torch._foreach_*`` ops).
        """
        return [self.update(group, p, s, snap) for p, s, snap in zip(params, states, snapshots)]

    def keeps_grad(self, group: dict[str, Any]) -> bool:
        """Whether the step leaves ``p.grad`` of ``group``'s parameters as it was, so that the grads'
        sums may be taken after it (decided before the step). Default: True."""
        return True

    def silent(self, group: dict[str, Any]) -> bool:
        """Whether the step just taken left every parameter of ``group`` unchanged by the optimizer's
        own design (a silent warm-up phase), read after the step: health then counts none of them as
        unchanged nor any update as lost. Default: False."""
        return False

    def fusable(self, group: dict[str, Any]) -> bool:
        """Whether :meth:`fused` serves ``group`` (decided before the step). Default: False."""
        return False

    def fused(self, group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]]
              ) -> tuple[Any, tuple[Any, ...], Tensor, Tensor | None] | None:
        """The compiled capture's form of :meth:`update_many` (see :mod:`monitored_optim.capture.fused`):
        ``(rebuild, args, c, s)``, d = c·r with ``rebuild(*args)`` giving r per parameter and ``s``
        the decoupled-decay factor (None without it); None where it has none for these states.
        Default: None."""
        return None


OPTIONAL = ("elementwise", "checks_store", "bound", "stepping", "update_many", "keeps_grad", "silent", "fusable",
            "fused")
"""The capabilities a registered view without the :class:`View` base may leave out (:func:`adopt`)."""


def bind(view: View, optimizer: Any) -> View:
    """``view`` bound to ``optimizer`` (:meth:`View.bound`), adopted (:func:`adopt`).

    Raises:
        TypeError: what ``bound()`` returned is not a view.
    """
    bound = view.bound(optimizer)
    try:
        return adopt(bound)
    except TypeError as err:
        raise TypeError(f"monitored_optim: {type(view).__name__}.bound() returned {bound!r} for "
                        f"{type(optimizer).__name__}, not a view ({err})") from err


def adopt(view: Any) -> View:
    """``view`` with each capability of :data:`OPTIONAL` it lacks set to :class:`View`'s default, so
    that the monitor uses every view alike; a :class:`View` is returned as is.

    The object itself is completed, not wrapped: it stays the object its author registered (what
    ``view_for`` returns and ``describe()`` names).

    Raises:
        TypeError: ``view`` lacks a ``before`` or ``update`` method, has a capability of
            :data:`OPTIONAL` that should be a method and is not, or cannot take attributes
            (``__slots__``): subclass :class:`View` instead.
    """
    if isinstance(view, View):
        return view
    if not (callable(getattr(view, "before", None)) and callable(getattr(view, "update", None))):
        raise TypeError(f"register() expects a view with before() and update() methods, got {view!r}")
    for name in OPTIONAL:
        if hasattr(view, name) and callable(getattr(View, name)) and not callable(getattr(view, name)):
            raise TypeError(f"register() expects {name!r} of {view!r} to be a method, like View.{name}; "
                            f"got {getattr(view, name)!r}")
        if not hasattr(view, name):
            default = getattr(View, name)
            try:
                setattr(view, name, default.__get__(view) if callable(default) else default)
            except AttributeError as err:
                raise TypeError(f"register() cannot give {view!r} the default {name!r} ({err}); "
                                "subclass monitored_optim.updates.View instead") from err
    return cast(View, view)

"""Turns: the stored change of each parameter measured inside the optimizer's own step, one parameter at a time.

Some optimizers keep no state that a view could rebuild u = p_after - p_before from (block-wise
quantized moments: bitsandbytes' 8-bit optimizers, torchao's 8-bit, 4-bit and FP8 AdamW; moments of a
low-rank projection of the grad: GaLore), yet their step updates one parameter after another: each
parameter's *turn* (its state looked up, its update computed and stored) ends before the next one's
begins. For such a step a logging step takes no copy of the model: when a parameter's turn begins, p is
copied (p_before, exact); when it ends, the sums of u = p_after - p_before are taken, a block at a time
in float64, and the copy is dropped. A logging step then holds one parameter's copy at a time, at most
the largest parameter's bytes (plus two blocks of float64, 512 KiB), where the clone route held all of them.

What marks a turn is known per optimizer class (``VIEWS`` of ``monitored_optim.updates.thirdparty``):

* :class:`Method`: the step calls a method once per parameter, the parameter among its arguments
  (bitsandbytes' ``Optimizer8bit.step`` calls ``self.update_step(group, p, gindex, pindex)``); the
  method is wrapped on the instance for the step: p copied, the method called with the same arguments
  once, the sums taken.
* :class:`Lookup`: the step looks up ``self.state[p]`` first of all in each parameter's turn (torchao's
  ``_AdamBase.step``, GaLore's ``AdamW.step`` and ``AdamW8bit.step``); for the step, ``self.state`` is a
  mapping with the same entries whose lookup of a parameter begins its turn and ends the last one (the
  end of the step ends the last turn); after the step the optimizer's own mapping is back, holding what
  the step put in it, in its order.

Either way the optimizer's arithmetic is untouched: the trajectory is the plain optimizer's, bit for
bit. The sums are a :class:`~monitored_optim.updates.clone.Summed`, filled in during the step, which
the capture reduces like any other (the view returns it after the step). Where the capture needs u
element by element (a figure family's ``part`` hook, verify mode's own copy) it copies p_before as
before. Source: bitsandbytes 0.50 ``optim/optimizer.py`` (``Optimizer8bit.step``), torchao 0.18
``optim/adam.py`` (``_AdamBase.step``), GaLore 1.0 ``galore_torch/adamw.py``, ``adamw8bit.py``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import Tensor

from .clone import Cloned, Summed
from .view import View

BLOCK = 1 << 15
"""Elements of u formed at once while a turn's sums are taken (two buffers of 256 KiB of float64)."""


class Turns:
    """The turns of one optimizer's logging steps: which parts wait for their parameter's turn, the copy
    of the parameter whose turn is on, and which sums were filled in.

    Args:
        marker: what marks a turn in this optimizer's step (:class:`Method` or :class:`Lookup`).
        optimizer: the optimizer, held weakly.
    """

    def __init__(self, marker: Method | Lookup, optimizer: Any) -> None:
        self.marker = marker
        self._optimizer = weakref.ref(optimizer)
        self._waiting: dict[int, list[tuple[Tensor, Summed]]] = {}  # storage address -> its parts' sums
        self._current: tuple[Tensor, Tensor, list[tuple[Tensor, Summed]]] | None = None
        self._ran: set[int] = set()  # ids of the sums filled in by the last step
        self._done = True  # the last logging step's step has run: the next take() begins a new one

    def take(self, p: Tensor) -> Summed | None:
        """The sums of ``p``'s stored change (a whole parameter, or a flat slice of a contiguous one), to
        be filled in during its parameter's turn of the coming step; None where a turn cannot measure it
        (complex, sparse, not contiguous, bf16/fp16, a tensor subclass, or an optimizer not ready for
        its ``marker``), which then takes a clone."""
        optimizer = self._optimizer()
        if optimizer is None or not self.marker.ready(optimizer) or type(p) not in (Tensor, torch.nn.Parameter) \
                or p.dtype not in (torch.float32, torch.float64) or p.layout is not torch.strided \
                or not p.is_contiguous():
            return None
        if self._done:
            self._waiting, self._ran, self._done = {}, set(), False
        sums = Summed(p.new_zeros(3, dtype=torch.float64), p.numel(), replayed=False)
        self._waiting.setdefault(_address(p), []).append((p, sums))
        return sums

    def ran(self, sums: Summed) -> bool:
        """Whether ``sums`` were filled in by the last step (False: its parameter had no turn, so the
        step left it as it was)."""
        return id(sums) in self._ran

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """The base step of a logging step runs inside: each waiting part's turn is measured."""
        optimizer = self._optimizer()
        try:
            if optimizer is None or not self._waiting or self._done:
                yield
                return
            with self.marker.installed(optimizer, self):
                yield
        finally:
            self.end()
            self._waiting, self._done = {}, True

    def begin(self, p: Any) -> None:
        """A turn of ``p`` begins: the turn on, if it is another parameter's, ends; ``p``, if parts of it
        wait, is copied (the parts within its elements: another parameter may share its storage)."""
        if not isinstance(p, Tensor):
            return
        if self._current is not None:
            if self._current[0] is p:
                return
            self.end()
        if type(p) not in (Tensor, torch.nn.Parameter) or _address(p) not in self._waiting:
            return
        start, stop = p.storage_offset(), p.storage_offset() + p.numel()
        waiting: list[tuple[Tensor, Summed]] = []
        rest: list[tuple[Tensor, Summed]] = []
        for part, sums in self._waiting.pop(_address(p)):
            (waiting if start <= part.storage_offset() < stop else rest).append((part, sums))
        if rest:
            self._waiting[_address(p)] = rest
        if waiting:
            self._current = (p, p.detach().clone(), waiting)

    def end(self) -> None:
        """The turn on, if any, ends: the sums of each of its parts' stored change, the copy dropped."""
        if self._current is None:
            return
        p, copy, waiting = self._current
        self._current = None
        whole = p.detach()  # as it is now (GaLore's 8-bit step gives p new data in its turn)
        for part, sums in waiting:
            if part is p:
                after, before = whole, copy
            else:  # a flat slice of p's storage, which p kept
                after, before = part, copy.view(-1)[part.storage_offset() - p.storage_offset():][:part.numel()]
            _sums(after.reshape(-1), before.reshape(-1), sums.row)
            self._ran.add(id(sums))


def _address(p: Tensor) -> int:
    return p.untyped_storage().data_ptr()


def _sums(after: Tensor, before: Tensor, row: Tensor) -> None:
    """``row`` = (c, Σ(u - c), sqrt(Σ(u - c)²)) of u = after - before (flat, contiguous), formed in float64
    (exact for float32) a :data:`BLOCK` at a time; c the mean of the first block."""
    n = after.numel()
    if n == 0:
        return
    wide, low = (torch.empty(min(n, BLOCK), dtype=torch.float64, device=after.device) for _ in range(2))
    square = row.new_zeros(())
    for start in range(0, n, BLOCK):  # both sides widened into buffers: no mixed-dtype op's temporary
        m = min(BLOCK, n - start)
        u = wide[:m].copy_(after[start:start + m]).sub_(low[:m].copy_(before[start:start + m]))
        if start == 0:
            row[0] = u.mean()
        row[1] += u.sub_(row[0]).sum()
        square += u.square_().sum()
    row[2] = square.sqrt()


@dataclass(frozen=True)
class Method:
    """A turn is one call of the optimizer's method ``name``, the parameter its ``position``-th positional
    argument (bitsandbytes: ``update_step(group, p, gindex, pindex)``, position 1)."""

    name: str
    position: int

    def ready(self, optimizer: Any) -> bool:
        return True

    @contextlib.contextmanager
    def installed(self, optimizer: Any, turns: Turns) -> Iterator[None]:
        """The method wrapped on ``optimizer`` for the block: called once per call, with the same arguments."""
        own = self.name in vars(optimizer)
        method = getattr(optimizer, self.name)
        position = self.position

        def turn(*args: Any, **kwargs: Any) -> Any:
            turns.begin(args[position] if len(args) > position else None)
            try:
                return method(*args, **kwargs)
            finally:
                turns.end()

        setattr(optimizer, self.name, turn)
        try:
            yield
        finally:
            if own:
                setattr(optimizer, self.name, method)
            else:
                delattr(optimizer, self.name)


@dataclass(frozen=True)
class Lookup:
    """A turn begins where the step looks up ``self.state[p]`` and ends at the next parameter's lookup (or
    the end of the step). ``ready``: an attribute of the optimizer that must be true for its step to look
    up each parameter's state in its own turn only (bitsandbytes' ``initialized``: before it, the first
    step's ``to_gpu`` looks up every parameter's); None: always."""

    flag: str | None = None

    def ready(self, optimizer: Any) -> bool:
        return self.flag is None or bool(getattr(optimizer, self.flag, True))

    @contextlib.contextmanager
    def installed(self, optimizer: Any, turns: Turns) -> Iterator[None]:
        """``optimizer.state`` replaced for the block by a ``_Watched`` mapping with its entries; the
        original, given what the step put in, is back after it (the same object, its order kept)."""
        own = optimizer.state
        watched = _Watched(own.default_factory if isinstance(own, defaultdict) else dict)
        dict.update(watched, own)
        watched.turns = turns
        optimizer.state = watched
        try:
            yield
        finally:
            watched.turns = None
            optimizer.state = own
            own.clear()
            own.update(dict.items(watched))


class _Watched(defaultdict):
    """The optimizer's state during a step of :class:`Lookup`: a lookup of a parameter tells :attr:`turns`."""

    turns: Turns | None = None

    def __getitem__(self, key: Any) -> Any:
        if self.turns is not None:
            self.turns.begin(key)
        return super().__getitem__(key)


class TurnView(View):
    """The view of an optimizer whose step goes parameter by parameter (module docstring): each monitored
    float32/float64 parameter's stored change measured in its turn, from a copy of that parameter alone.

    Args:
        marker: what marks a turn in the step this view is registered for.
    """

    checks_store = True  # the turn measures the stored change itself: no rounding risk to copy for

    def __init__(self, marker: Method | Lookup, turns: Turns | None = None) -> None:
        self.marker, self.turns = marker, turns

    def bound(self, optimizer: Any) -> TurnView:
        """This view with the :class:`Turns` of ``optimizer``."""
        return TurnView(self.marker, Turns(self.marker, optimizer))

    def stepping(self) -> ContextManager[None]:
        return self.turns.stepping() if self.turns is not None else contextlib.nullcontext()

    def keeps_grad(self, group: dict[str, Any]) -> bool:
        """False: GaLore's 8-bit step writes the projected grad into ``p.grad`` (the grads' sums are taken
        before the step)."""
        return False

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Summed | Cloned | None:
        if p.grad is None:
            return None  # the step skips it
        taken = None if self.turns is None else self.turns.take(p)
        return taken if taken is not None else Cloned.of(p)

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Summed | None:
        return snapshot if isinstance(snapshot, Summed) and self.turns is not None and self.turns.ran(snapshot) \
            else None

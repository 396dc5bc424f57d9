"""Sharded, replicated and pipelined training: every figure describes the whole parameter, written once.

Under ``torch.distributed`` each rank holds a shard of a parameter, a copy of it, a fragment of a
flat buffer, or none of it (another pipeline stage's). On a logging step the monitor reads, through
``Sharding.local``, only plain local tensors: the views rebuild the update of what the rank
holds, and :func:`monitored_optim.stats.moments` reduces p_before, grad and update to
``(mean, m2)`` exactly as in the single-process path (no DTensor reduction, so no hidden
collective). :mod:`~.table` then sums every rank's pieces in **one** ``all_reduce`` and one host copy.

One module per layout says what a rank holds of each parameter (a :class:`~.held.Held`: its local
tensor, and how many shards the ranks holding it have between them, which weighs it):

=====================================  ===========================================  =================
layout                                 this rank's shard                            shards
=====================================  ===========================================  =================
:mod:`~.replicated` (DDP, tensor-      the parameter                                1 (a replica)
parallel unplanned, ZeRO wrapped as
the monitored class)
:mod:`~.dtensor` (FSDP2, tensor        the DTensor's local tensor                   product of the
parallel)                                                                           sharded mesh dims
:mod:`~.fsdp1` (FSDP1 views or         the local shard, its padding excluded        the unit's group
``FlatParameter``)                                                                  size
:mod:`~.zero` (torch's ZeRO inner      the parameter where this rank owns it        ZeRO's group size
optimizer)                                                                          (0 elsewhere)
:mod:`~.deepspeed` (DeepSpeed ZeRO     each model parameter's fragment of the       each element on
0-3 flat partitions)                   flat fp32 partition the optimizer steps      one rank only
:mod:`~.pipeline` (stages)             what the stage holds, by any layout above    by name over the
                                                                                    stages' union
=====================================  ===========================================  =================

Uneven and empty shards need nothing special: an empty one contributes ``n = 0``. A value missing on
a rank (no grad on an empty shard, an unchanged shard) counts as zeros there; a grad exists if any
rank had one. Every rank always joins the collective. Views that are not element-wise (Muon,
Adafactor) cannot rebuild a split parameter's update from its shard: such shards are cloned
(:meth:`Sharding.cloned`). Only rank 0 of the default group writes to the backends
(:func:`is_writer`); every rank gets the figures of every parameter.

Assumptions (SPMD training): every rank of the default group calls ``step()`` of its monitored
optimizer on the same steps; a name means the same parameter on every rank that monitors it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from .. import stats
from .._warnings import Once, warn
from ..updates import View, elementwise
from . import dtensor, fsdp1, replicated, zero
from .held import Held, is_dtensor, narrow, set_local_grad, whole_shape
from .pipeline import Ranks, Remote
from .table import Captured, Gathered, collective_device

if TYPE_CHECKING:
    from ..pieces import Keys
    from .deepspeed import Layout


def initialized() -> bool:
    """True when ``torch.distributed`` is available and its default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def is_writer() -> bool:
    """True in the one process that writes figures: rank 0 of the default group, or any process
    that is not part of an initialised ``torch.distributed`` job."""
    return not initialized() or dist.get_rank() == 0


def sharding(optimizer: torch.optim.Optimizer, layout: Layout | None = None) -> Sharding | Unsharded:
    """The :class:`Sharding` of ``optimizer`` for this logging step, or :class:`Unsharded` outside
    ``torch.distributed`` (the single-process path, untouched).

    Call on every rank at the same logging step, before the base step (it reads the grads).
    ``layout``: a DeepSpeed wrapper's layout (:class:`~.deepspeed.Layout`), which lists the groups
    itself. Issues no collective unless a grad is laid out unlike its parameter (a ``Partial``
    grad), which is redistributed to the parameter's placements.
    """
    if not initialized():
        return Unsharded(optimizer)
    if layout is not None:
        return Sharding(optimizer, layout.groups())
    parent = zero.parent(optimizer)
    source = parent if parent is not None else optimizer
    return Sharding(optimizer, [(group, [_held(p, parent) for p in group["params"]]) for group in source.param_groups])


def _held(p: Tensor, parent: Any) -> Held:
    """What this rank holds of ``p``, by its layout."""
    if parent is not None:
        return zero.held(p, parent)
    if is_dtensor(p):
        return dtensor.held(p)
    return fsdp1.held(p) or replicated.held(p)


class Unsharded:
    """One process's optimizer, read as it is: the layout of a logging step outside ``torch.distributed``,
    beside :class:`Sharding`, whose attributes and methods of the same names answer for a sharded one.

    Attributes:
        local: the optimizer itself.
        shape: None: each parameter's shape is its own.
    """

    sharded: Literal[False] = False
    """Whether a parameter may be split across ranks (then parts are not cut, nor the fused routes taken)."""

    shape = None

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.local = optimizer

    @staticmethod
    def cloned(view: View) -> frozenset[int]:
        """No tensor: every view rebuilds the update of a whole parameter."""
        return frozenset()

    def regrad(self, params: set[int] | None = None) -> None:
        """Nothing: each tensor read is the parameter, with its own grad."""

    def groups_of(self, params: set[int]) -> set[int]:
        """The indices of the param groups that hold a parameter whose id is in ``params``."""
        return {i for i, group in enumerate(self.local.param_groups) if any(id(p) in params for p in group["params"])}

    def release(self, entries: Sequence[Captured]) -> None:
        """Nothing: the grads read are the parameters' own, which the optimizer keeps."""

    def reduce(self, entries: Sequence[Captured], rows: stats.Moments, index: Tensor, lrs: list[Tensor], keys: Keys,
               ranks: Ranks, cost: tuple[float, float] = (0.0, 0.0)) -> Gathered:
        """This process's values on the host, in one device-to-host copy per device: the moments of the
        slots ``index`` names, each entry's pieces and the Tensor learning rates ``lrs`` (``keys``,
        ``ranks``, ``cost``: unused, as nothing is summed over ranks)."""
        holding = [i for i, e in enumerate(entries) if e.pieces]  # a flat entry's: its histograms, if any
        pieces = [piece for i in holding for piece in entries[i].pieces.values()]
        pairs, present, extra = rows.host(index, pieces + lrs)
        it = iter(extra[:len(pieces)])  # per entry, its pieces' host values in the order of its pieces
        own: list[dict[str, list[float]]] = [{} for _ in range(len(entries))]
        for i in holding:
            own[i] = {key: next(it) for key in entries[i].pieces}
        return Gathered(rows.sizes[index[:, 0]], pairs, present, own, extra[len(pieces):])  # p_before: once each


class Sharding:
    """One logging step's view of a sharded optimizer: local tensors to read, what each is, the reduction.

    Args:
        optimizer: the optimizer (its ``state`` is read).
        groups: per param group of the view, the group (its hyperparameters; ``param_names`` where
            the shards bring no names of their own) and what this rank holds of each of its parameters.

    Attributes:
        local: an optimizer-like object (``param_groups``, ``state``, ``defaults``) for the monitor to
            read instead of the optimizer: the groups, each parameter replaced by its local tensor
            (``Held.local``), whose ``.grad`` is the matching local grad; the ``state``
            mapping answers for a local tensor with the state of its parameter, each ``DTensor`` in
            it replaced by its local tensor and each tensor shaped like the parameter narrowed to
            the local shard. Plain parameters are passed through as they are.
        held: per local tensor in ``local`` order, its :class:`~.held.Held`.
        left_out: keys of the pieces the reduction left out (a WHOLE piece of a split parameter).
    """

    sharded: Literal[True] = True

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[tuple[dict[str, Any], list[Held]]]) -> None:
        self._state = optimizer.state
        self._held: dict[int, Held] = {}
        self._grad_seen: dict[int, Tensor | None] = {}
        self._regrad: set[int] = set()
        self.held: list[Held] = []
        self.left_out: set[str] = set()
        local_groups = []
        self._groups = [{id(h.param) for h in shards} for _, shards in groups]
        for group, shards in groups:
            for h in shards:
                self._held[id(h.local)] = h
                self.held.append(h)
                if h.local is not h.param:
                    set_local_grad(h)
                    self._grad_seen[id(h.local)] = h.param.grad
            local_groups.append({**group, "params": [h.local for h in shards]})
        self.local = _LocalOptimizer(local_groups, _LocalState(self), optimizer.defaults)

    def cloned(self, view: View) -> frozenset[int]:
        """The ids of the local tensors whose update ``view`` cannot rebuild: shards of split parameters
        where the view is not element-wise (Muon's Newton-Schulz on the whole matrix, Adafactor's row
        and column means). The capture's plan clones them: exact, one copy of the shard on logging
        steps. Whole parameters (replicas, ZeRO) keep the view."""
        return frozenset() if elementwise(view) else frozenset(id(h.local) for h in self.held if h.split)

    def regrad(self, params: set[int] | None = None) -> None:
        """Point each local tensor's ``.grad`` at its parameter's grad now (``params``: only those of
        the parameters with these ids), as an engine that sets grads just before it steps needs."""
        for h in self.held:
            if h.local is not h.param and (params is None or id(h.param) in params):
                set_local_grad(h)
                self._grad_seen[id(h.local)] = h.param.grad

    def groups_of(self, params: set[int]) -> set[int]:
        """The indices of the groups of ``local`` that hold a piece of a parameter whose id is in ``params``."""
        return {i for i, ids in enumerate(self._groups) if not ids.isdisjoint(params)}

    def release(self, entries: Sequence[Captured]) -> None:
        """Let go of the grads of these entries' local tensors (an engine frees its grads after each
        base step; holding them to the end of the logging step would keep a copy's worth)."""
        for e in entries:
            for t in (e.p, e.whole):
                t.grad = None
                if id(t) in self._grad_seen:
                    self._grad_seen[id(t)] = None

    def refresh_grad(self, shard: Tensor) -> None:
        """Point ``shard.grad`` at the parameter's current grad, if a closure made a new one.

        The capture reads ``state`` just before each view call."""
        if id(shard) in self._grad_seen:
            h = self._held[id(shard)]
            if h.param.grad is not self._grad_seen[id(shard)]:
                self._grad_seen[id(shard)] = h.param.grad
                self._regrad.add(id(shard))
                set_local_grad(h)

    def shape(self, local: Tensor) -> torch.Size:
        """The whole parameter's shape of a local tensor (a model parameter's, for a flat buffer's fragment)."""
        h = self._held.get(id(local))
        if h is None:
            return local.shape
        return whole_shape(h.source if h.source is not None else h.param)

    def _whole(self, local: Tensor) -> bool:
        """Whether :meth:`shape` is the whole parameter's (an FSDP1 shard's shape is its own)."""
        h = self._held.get(id(local))
        return h is None or not h.split or h.source is not None or is_dtensor(h.param)

    def original(self, shard: Tensor) -> Tensor:
        """The parameter whose local shard is ``shard``."""
        h = self._held.get(id(shard))
        return shard if h is None else h.param

    def localize_state(self, shard: Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as ``shard`` sees it: local tensors of DTensors, tensors shaped like the
        parameter narrowed to the shard. A plain state dict is returned as is."""
        h = self._held.get(id(shard))
        span = None if h is None else h.span
        if span is None and not any(is_dtensor(v) for v in state.values()):
            return state
        out = {}
        for key, value in state.items():
            if is_dtensor(value):
                value = value.to_local()
            elif span is not None and h is not None and isinstance(value, Tensor) and value.shape == h.param.shape:
                value = narrow(value, span, shard)
            out[key] = value
        return out

    def reduce(self, entries: Sequence[Captured], rows: stats.Moments, index: Tensor, lrs: list[Tensor], keys: Keys,
               ranks: Ranks, cost: tuple[float, float] = (0.0, 0.0)) -> Gathered:
        """Global host values of every entry's pieces: one ``all_reduce`` (:func:`.table.reduce`), and one
        host copy of the Tensor learning rates ``lrs``; warns once per key head about the pieces it left
        out (:func:`tell_left_out`).

        Args:
            entries: the monitor's lead entries, in ``local`` order (``.name``, ``.p``, ``.pieces``, ``.slots``).
            rows: the batch's moments, whose rows ``slots`` name (``index``: unused, as each entry's
                whole-parameter values are its own pieces here).
            keys: every key a piece may have -> its reduction, the same on every rank.
            ranks: the union of the ranks' names (:class:`~.pipeline.Ranks`), kept by the monitor.
            cost: this rank's ``(bytes copied, host seconds)`` so far, summed over the ranks.
        """
        from .table import reduce

        for e in entries:  # whole-parameter values and counts
            e.pieces.update({kind: row for kind, slot in e.slots.items() if (row := rows[slot]) is not None})
        for e in entries:
            if id(e.p) in self._regrad:  # a closure made a new grad inside step(): the shard saw it late
                e.pieces.pop("grad", None)
                if e.p.grad is not None:
                    e.pieces["grad"] = stats.moments(e.p.grad)
        local = [Remote(e.name, tuple(self.shape(e.p)), str(e.p.dtype), self._whole(e.p)) for e in entries]
        reduced = reduce(list(entries), local, [self._held[id(e.p)] for e in entries], keys, ranks, self.left_out, cost)
        tell_left_out(self.left_out, keys.heads, ranks.left_out)
        reduced.read = stats.Moments({}, {}, 0, torch.zeros(0)).host(torch.zeros(0, dtype=torch.long), lrs)[2]
        return reduced


def tell_left_out(keys: set[str], reductions: dict[str, str], told: Once) -> None:
    """Warn once per key head (``told``: those warned about before, by this monitor) that the
    sharded reduction left the figures of ``keys`` out, and why (``reductions``: head -> reduction); in
    the process that writes the figures alone, as every rank leaves out the same."""
    from ..pieces import WHOLE, head

    for first in told.new(sorted({head(key) for key in keys})):
        if not is_writer():
            continue
        if reductions.get(first) == WHOLE:
            warn(f"monitored_optim: the {first} figures of matrices sharded across ranks are left out: they "
                 "describe a whole matrix and each rank holds a shard (gathering the matrix would take a "
                 "collective per matrix); matrices that every rank holds whole keep them", RuntimeWarning)
        else:
            shown = ", ".join(sorted(key.replace(":", "/", 1) for key in keys if head(key) == first))
            warn(f"monitored_optim: {shown} left out under torch.distributed: only the state tensors of "
                 "torch's own optimizers have a place in the one collective", RuntimeWarning)


class _LocalOptimizer:
    """What the monitor reads instead of a sharded optimizer (see ``Sharding.local``)."""

    def __init__(self, param_groups: list[dict[str, Any]], state: _LocalState, defaults: dict[str, Any]) -> None:
        self.param_groups = param_groups
        self.state = state
        self.defaults = defaults


class _LocalState:
    """``state`` of ``Sharding.local``: read-only, keyed by local tensor, read at call time (the
    optimizer creates its state lazily during the first step)."""

    def __init__(self, sharding: Sharding) -> None:
        self._sharding = sharding

    def get(self, shard: Tensor, default: Any = None) -> Any:
        self._sharding.refresh_grad(shard)
        state = self._sharding._state.get(self._sharding.original(shard))
        return default if state is None else self._sharding.localize_state(shard, state)

    def __getitem__(self, shard: Tensor) -> Any:
        state = self.get(shard)
        if state is None:
            raise KeyError(shard)
        return state

    def __contains__(self, shard: object) -> bool:
        return isinstance(shard, Tensor) and self.get(shard) is not None


__all__ = ["Captured", "Gathered", "Sharding", "Unsharded", "collective_device", "initialized", "is_writer", "sharding",
           "tell_left_out"]

"""The layout of a logging step: the entries the capture fills, the parameters' names, and what of
them is derived from the monitored parameters alone, kept across logging steps while they stay the same.

A logging step's bookkeeping (which parameters are monitored and under which names, which storages
are shared, how the small ones fall into flat chunks) depends only on the param groups and the
tensors' metadata. Rebuilding it costs a few microseconds of Python per parameter; :func:`fingerprint`
costs about half of one and says when it must be rebuilt (measured on the benchmark's 2,000 small
tensors under SGD momentum, stepped in turn with other models as the benchmark does: the work before
the step 10.0 ms rebuilt at every logging step, 2.7 to 3.1 ms with the layout kept, of which the
fingerprint is about 1 ms and the flat copies of p_before 1.4 ms; a plain step is 13 to 15 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from . import capture, stats
from .updates import Cloned


@dataclass(slots=True)
class Entry:
    """One monitored parameter (or one part of a large one, ``lead`` then being the parameter's
    first part, which holds the slots and pieces) on a logging step.

    ``snapshot`` is the view's own (``Cloned`` where there is no view to run), ``copy`` the exact
    p_before of the snapshot rule where the view is still run (for ``update_lost`` and verify mode),
    ``clone`` verify mode's copy where there is neither."""

    name: str
    group: dict[str, Any]
    p: Tensor
    snapshot: Any
    part: capture.Part | None = None
    lead: Entry | None = None
    copy: Tensor | None = None
    slots: dict[str, int] = field(default_factory=dict)
    centred: dict[str, bool] = field(default_factory=dict)
    pieces: dict[str, Tensor] = field(default_factory=dict)
    clone: Tensor | None = None
    extremes: Tensor | None = None
    fused: bool = False
    flat: Flat | None = None

    @property
    def whole(self) -> Tensor:
        """The whole parameter this entry is (a part of)."""
        return self.p if self.part is None else self.part.whole

    @property
    def owner(self) -> Entry:
        """The entry that holds this part's slots and pieces."""
        return self if self.lead is None else self.lead

    @property
    def before(self) -> Tensor | None:
        """The exact p_before of this part, where one was taken."""
        return self.snapshot.before if isinstance(self.snapshot, Cloned) else self.copy


@dataclass(eq=False)
class Entries:
    """A logging step's entries: ``all`` in order (the parts of a large parameter one after another),
    ``leads`` (one per parameter, the entry that holds its slots and pieces), ``unflat`` (those not
    captured flat: a flat entry is its layout's, the same at every logging step) and ``befores``,
    the flat copy of p_before of each of the layout's flat chunks, taken just before the step (the
    step's own: nothing of it outlives the step)."""

    all: list[Entry]
    leads: list[Entry]
    unflat: list[Entry]
    befores: list[Tensor]


@dataclass(eq=False)  # hashed by identity
class Flat:
    """A chunk of small parameters captured flat (``fused.flat``): its entries (those whose ``flat``
    it is), their parameters and their lengths (element counts, as a list and as a tensor on their
    device)."""

    members: list[Entry]
    params: list[Tensor]
    sizes: list[int]
    lengths: Tensor


def names(optimizer: torch.optim.Optimizer, known: dict[int, str] | None = None) -> list[list[str]]:
    """Each group's ``param_names``, else each parameter's name in ``known`` (id -> name from a
    watched model), else ``param{k}`` numbered across groups.

    A name given twice (two modules' ``named_parameters()`` in two groups both say ``weight``, or two
    parameters of one group) gets ``@group{i}`` appended where it repeats (:func:`_unique`), so that
    no figure or health count overwrites another.
    """
    names, k, seen, known = [], 0, set(), known or {}
    for i, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")
        own = list(given) if given else [known[id(p)] if id(p) in known else f"param{k + j}"
                                         for j, p in enumerate(group["params"])]
        if not seen.isdisjoint(own) or len(set(own)) < len(own):
            own = _unique(own, seen, i)
        seen.update(own)
        names.append(own)
        k += len(group["params"])
    return names


def _unique(own: list[str], seen: set[str], i: int) -> list[str]:
    """The names of param group ``i``, each one taken before (in ``seen``, or earlier in the group:
    two parameters, or one listed twice) with ``@group{i}`` appended, and where that is taken too,
    also the parameter's index in the group."""
    taken, out = set(seen), []
    for j, n in enumerate(own):
        if n in taken:
            n = f"{n}@group{i}" if f"{n}@group{i}" not in taken else f"{n}@group{i}.{j}"
        taken.add(n)
        out.append(n)
    return out


_PLAIN = (Tensor, torch.nn.Parameter)
"""Tensor types with a storage of their own (a subclass such as ``DTensor`` may have none)."""


def fingerprint(optimizer: torch.optim.Optimizer, extra: Any) -> list[Any]:
    """What a :class:`Layout` of ``optimizer``'s parameters is derived from: per param group its
    identity and its ``param_names``, per parameter its identity, type, dtype, device, shape, layout
    and data address (which parameters share storage is the layout's: ``p.data = q.data`` changes
    it), after ``extra`` (the monitor's own inputs). Two equal fingerprints give the same layout.
    Grads are not read: none of the layout's decisions depends on them (each logging step reads them
    itself), and reading them made it twice as slow (1.9 against 1.0 ms for 2,000 small tensors
    inside logging steps).

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        extra: any value compared with ``==`` (the monitor's fusion decisions and known names).

    Returns:
        A list of ``1 + len(param_groups) + number of parameters`` items, compared with ``==``
        (identities, dtypes, devices, shapes; never a tensor's values).
    """
    key = [extra]
    for group in optimizer.param_groups:
        key.append((id(group), tuple(group.get("param_names") or ())))
        key += [(id(p), type(p), p.dtype, p.device, p.shape, p.layout,
                 p.data_ptr() if type(p) in _PLAIN and p.layout is torch.strided else None) for p in group["params"]]
    return key


@dataclass(eq=False)
class Layout:
    """What a logging step derives from the monitored parameters alone (:func:`fingerprint`), kept
    while it stays the same: the names per param group; per param group, the group, its fused way
    (``Monitor._fusion``) and its chosen parameters in order, as runs of consecutive ones captured
    flat (lists of their entries) and ``(name, p, kind)`` for the others (``kind``: ``"whole"`` or
    None, see ``Monitor._fusable``); the ids of parameters whose storage is shared, the capture's
    chunk budget in bytes and the flat chunks. It holds the parameters and groups it lists (their
    ids stay theirs) until a logging step builds another, or ``opt.monitor.close()``."""

    key: list[Any]
    names: list[list[str]]
    mask: list[bool] | None
    groups: list[tuple[dict[str, Any], str | None, list[list[Entry] | tuple[str, Tensor, str | None]]]]
    shared: set[int]
    budget: int
    chunks: list[Flat]


@dataclass(eq=False)
class Roster:
    """What a logging step's figures read of its entries that the entries' composition alone decides,
    kept while it stays the same (:func:`composition`): per parameter (one per lead entry, in order)
    its name, its slots, its whole shape, the rounding unit of its dtype, the identity of its param
    group; which parameters are in bf16/fp16 (their ``update_lost``) and which were not captured
    flat (their centring decisions are kept for the eager capture).

    Attributes:
        layout: the :class:`Layout` the entries came from.
        composition: :func:`composition` of the entries.
        names: ``N`` parameter names.
        index: int64 ``(N, K)``, each parameter's slot per kind of ``stats.KINDS``.
        shapes: ``N`` ``torch.Size``.
        eps: float64 ``(N,)``, ``capture.eps`` of each dtype.
        groups: ``N`` ints, ``id`` of each parameter's param group.
        low: indices of the parameters in bf16/fp16.
        captured: indices of the parameters not captured flat.
        position: name -> index.
    """

    layout: Layout
    composition: list[tuple[str, bool, bool, tuple[int, ...]]]
    names: list[str]
    index: Tensor
    shapes: list[torch.Size]
    eps: Tensor
    groups: list[int]
    low: list[int]
    captured: list[int]
    position: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.position = {name: i for i, name in enumerate(self.names)}

    @classmethod
    def of(cls, layout: Layout, composition: list[tuple[str, bool, bool, tuple[int, ...]]], leads: list[Entry]
           ) -> Roster:
        """The roster of a logging step's ``leads`` (the entries that hold slots), from ``layout``."""
        eps_of = {dtype: capture.eps(dtype) for dtype in {e.p.dtype for e in leads}}
        index = torch.tensor([e.slots[kind] for e in leads for kind in stats.KINDS], dtype=torch.long)
        eps = torch.tensor([eps_of[e.p.dtype] for e in leads], dtype=torch.float64)
        low = [i for i, e in enumerate(leads) if e.p.dtype in capture.LOW_PRECISION]
        return cls(layout, composition, [e.name for e in leads], index.reshape(-1, len(stats.KINDS)),
                   [e.whole.shape for e in leads], eps, [id(e.group) for e in leads], low,
                   [i for i, e in enumerate(leads) if e.flat is None])


def composition(entries: list[Entry]) -> list[tuple[str, bool, bool, tuple[int, ...]]]:
    """What decides a logging step's :class:`Roster` beyond its layout: per entry not captured flat (a
    flat one is the layout's own), its name, whether it leads its parameter's parts, whether the
    fused capture takes it, and its slots (a step with a closure gives the eager capture's grads
    slots of their own; the flat runs' slots follow from the rest)."""
    return [(e.name, e.lead is None, e.fused, tuple(e.slots.values())) for e in entries if e.flat is None]

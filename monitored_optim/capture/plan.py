"""The plan of a logging step: which parameters are captured, under which names, and by which route.

Everything here depends on the param groups and the tensors' metadata alone, so a :class:`Plan` is
kept across logging steps while its :func:`fingerprint` stays the same. It decides each parameter's
route once (:mod:`~monitored_optim.capture.route`): runs of small parameters captured flat, and a
:class:`~monitored_optim.capture.route.Planned` for each other one, whose route a logging step reads
with what only it knows (the snapshot rule's rounding risk, a dense grad).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from .. import stats
from .._warnings import Once, warn
from ..models import own_names, unnamed
from ..updates import CLONE, Cloned, View, elementwise
from .rules import LOW_PRECISION, eps as machine_eps, shared
from .change import Part, budget as chunk_budget, slices
from .route import CLONED, FLAT, INTEGER, SKIPPED, Planned, Route

if TYPE_CHECKING:
    from ..distributed.pipeline import Remote


@dataclass(slots=True)
class Entry:
    """One monitored parameter, or one part of a large one, on a logging step.

    ``lead`` is the parameter's first part, which holds the slots and pieces (None for that part).
    ``snapshot`` is what the view keeps of p_before (``Cloned`` where p_before was copied instead of
    running the view); ``kept`` a copy of p_before beside it: the snapshot rule's, where the view still
    runs (for ``update_lost`` and verify mode), or, where ``verifies``, verify mode's, which only checks
    the inversion. :attr:`before` is the exact p_before u is taken from, :attr:`clone` verify mode's."""

    name: str
    group: dict[str, Any]
    p: Tensor
    snapshot: Any
    part: Part | None = None
    lead: Entry | None = None
    slots: dict[str, int] = field(default_factory=dict)
    centred: dict[str, bool] = field(default_factory=dict)
    pieces: dict[str, Tensor] = field(default_factory=dict)
    kept: Tensor | None = None
    verifies: bool = False
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
        """The exact p_before of this part that u is taken from, where one was taken."""
        if isinstance(self.snapshot, Cloned):
            return self.snapshot.before
        return None if self.verifies else self.kept

    @property
    def clone(self) -> Tensor | None:
        """Verify mode's copy of p_before, where u is inverted (None elsewhere, and once checked)."""
        return self.kept if self.verifies else None


@dataclass(eq=False)
class FlatRun:
    """Consecutive parameters of a param group captured flat: their entries, each copied into its
    chunk's flat buffer before the step (:class:`Flat`), and their route."""

    entries: list[Entry] = field(default_factory=list)
    route: Route = Route(FLAT)


@dataclass(eq=False)
class Entries:
    """A logging step's entries: ``all`` in order (the parts of a large parameter one after another),
    ``leads`` (one per parameter, the entry that holds its slots and pieces), ``unflat`` (those not
    captured flat: a flat entry is its plan's, the same at every logging step) and ``befores``,
    the flat copy of p_before of each of the plan's flat chunks, taken just before the step (the
    step's own: nothing of it outlives the step)."""

    all: list[Entry] = field(default_factory=list)
    leads: list[Entry] = field(default_factory=list)
    unflat: list[Entry] = field(default_factory=list)
    befores: list[Tensor] = field(default_factory=list)

    def extend(self, more: Entries) -> None:
        """Add the entries of another call of the base step in the same logging step (an engine
        that steps its param groups one call at a time), after these."""
        self.all += more.all
        self.leads += more.leads
        self.unflat += more.unflat
        self.befores += more.befores


@dataclass(eq=False)  # hashed by identity
class Flat:
    """A chunk of small parameters captured flat (``fused.flat``): its entries (those whose ``flat``
    it is), their parameters and their lengths (element counts, as a list and as a tensor on their
    device)."""

    members: list[Entry]
    params: list[Tensor]
    sizes: list[int]
    lengths: Tensor


def names(optimizer: Stepped, known: dict[int, str] | None = None) -> list[list[str]]:
    """Each group's ``param_names`` (as the plain model names them, whatever wrapped it when they were
    taken: :func:`~monitored_optim.models.own_names`), else each parameter's name in ``known`` (id ->
    name from a watched model), else ``param{k}`` numbered across groups.

    A group whose ``param_names`` are not as many as its parameters (an engine replaced them with
    flat buffers of its own, which are none of the named parameters) is named as if it had none.

    A name given twice (two modules' ``named_parameters()`` in two groups both say ``weight``, or two
    parameters of one group) gets ``@group{i}`` appended where it repeats (:func:`_unique`), so that
    no figure or health count overwrites another.
    """
    names: list[list[str]] = []
    seen: set[str] = set()
    k, known = 0, known or {}
    given = [group.get("param_names") if len(group.get("param_names") or ()) == len(group["params"]) else None
             for group in optimizer.param_groups]  # None: none, or an engine put buffers of its own in the group
    plain = iter(own_names((n, p) for group, named in zip(optimizer.param_groups, given) if named
                           for n, p in zip(named, group["params"])))  # one call: at most one scan
    for i, (group, named) in enumerate(zip(optimizer.param_groups, given)):
        own = [next(plain) for _ in named] if named else [
            known[id(p)] if id(p) in known else unnamed(k + j) for j, p in enumerate(group["params"])]
        if not seen.isdisjoint(own) or len(set(own)) < len(own):
            own = _unique(own, seen, i)
        seen.update(own)
        names.append(own)
        k += len(group["params"])
    return names


def born(optimizer: torch.optim.Optimizer, known: dict[int, str], select: Callable[[str, Tensor], bool],
         told: Once | None) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """The optimizer's ``(name, parameter)`` pairs as it was built, and those ``select`` chooses
    (``known``: id -> name from watched models, :func:`names`).

    Warns where the selection chooses none, and, once per ``told`` (None: never), where parameters
    have no names."""
    nameless = any(not g.get("param_names") and any(id(p) not in known for p in g["params"])
                   for g in optimizer.param_groups)
    if nameless and told is not None and told.first("unnamed"):
        warn("monitored_optim: the optimizer's parameters have no names, so figures are logged as "
             "param0, param1, ...; pass model.named_parameters() (or param groups whose 'params' are "
             "(name, tensor) pairs), or MonitorConfig(model=model), to log them by name")
    every, chosen = selected(optimizer, known, select)
    if every and not chosen:
        warn(f"monitored_optim: the parameter selection (MonitorConfig params=/exclude= or MONITORED_OPTIM_PARAMS) "
             f"matches none of the {len(every)} parameters, so nothing is monitored; their names look like "
             f"{every[0][0]!r}", RuntimeWarning)
    return every, chosen


def selected(optimizer: torch.optim.Optimizer, known: dict[int, str], select: Callable[[str, Tensor], bool]
             ) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """The optimizer's ``(name, parameter)`` pairs, and those ``select`` chooses (``known``: id -> name
    from watched models, :func:`names`)."""
    every = [(n, p) for group, own in zip(optimizer.param_groups, names(optimizer, known))
             for n, p in zip(own, group["params"])]
    return every, [(n, p) for n, p in every if select(n, p)]


def tell_unmapped(optimizer: Stepped, told: Once) -> None:
    """Warn, once per ``told``, where a param group's names are not as many as its tensors (an
    engine, an optimizer wrapper the monitor does not know, stepped buffers of its own, named
    ``param{k}``)."""
    odd = [group for group in optimizer.param_groups
           if group.get("param_names") and len(group["param_names"]) != len(group["params"])]
    if odd and told.first("unmapped"):
        warn(f"monitored_optim: a param group names {len(odd[0]['param_names'])} parameters but holds "
             f"{len(odd[0]['params'])} tensor(s): something replaced them with buffers of its own that the monitor "
             "cannot map back to the named parameters, so their figures are logged as param0, param1, ... (the "
             "tensors the optimizer steps), not under the parameters' names", RuntimeWarning)


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


def fingerprint(optimizer: Stepped, extra: Any) -> list[Any]:
    """What a :class:`Plan` of ``optimizer``'s parameters is derived from: per param group its
    identity and its ``param_names``, per parameter its identity, type, dtype, device, shape, layout
    and data address (which parameters share storage is the plan's: ``p.data = q.data`` changes
    it), after ``extra`` (the capture's own inputs). Two equal fingerprints give the same plan.
    Grads are not read: no decision of the plan depends on them (each logging step reads them).

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        extra: any value compared with ``==`` (the fused ways, the clones, the known names).

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


class Stepped(Protocol):
    """What the capture reads of an optimizer: a ``torch.optim.Optimizer``, or under
    ``torch.distributed`` its local view (``Sharding.local``)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> Any: ...


@dataclass(eq=False)
class Plan:
    """What a logging step derives from the monitored parameters alone (:func:`fingerprint`), kept
    while it stays the same. It holds the parameters and groups it lists until a logging step
    builds another, or ``opt.monitor.close()``.

    Attributes:
        key: the :func:`fingerprint` it was built for.
        names: each param group's parameter names (:func:`names`).
        mask: per parameter, whether the selection chose it (None: every parameter).
        groups: per param group, ``(group, items)``: its chosen parameters in order, as runs of
            consecutive ones captured flat (:class:`FlatRun`) and a
            :class:`~monitored_optim.capture.route.Planned` for each other one.
        shared: ids of the parameters whose storage another parameter shares.
        budget: the capture's chunk budget in bytes (:func:`~monitored_optim.capture.change.budget`).
        chunks: the flat chunks.
    """

    key: list[Any]
    names: list[list[str]]
    mask: list[bool] | None
    groups: list[tuple[dict[str, Any], list[FlatRun | Planned]]]
    shared: set[int]
    budget: int
    chunks: list[Flat]


def build(optimizer: Stepped, key: list[Any], named: list[list[str]], mask: list[bool] | None,
          ways: tuple[str | None, ...], forms: Forms, view: View, cloned: frozenset[int] = frozenset(),
          split: bool = True) -> Plan:
    """A new :class:`Plan` of ``optimizer``'s parameters, each one's route decided.

    Args:
        optimizer: the optimizer, or under ``torch.distributed`` its local view.
        key: its :func:`fingerprint`.
        named: each param group's parameter names (:func:`names`).
        mask: per parameter, whether the selection chose it (None: every parameter).
        ways: each param group's fused way (None, ``"copy"`` or ``"rebuild"``).
        forms: the fused routes' forms and chunks (:class:`~monitored_optim.capture.fused.Fused`).
        view: the update view (the clone view: every parameter cloned; an element-wise one cuts).
        cloned: ids of the parameters to clone (shards that the view cannot rebuild).
        split: whether large parameters may be cut into slices.
    """
    chosen = iter(mask) if mask is not None else None
    picked = [(group, way, [(n, p) for n, p in zip(own, group["params"]) if chosen is None or next(chosen)])
              for group, way, own in zip(optimizer.param_groups, ways, named)]
    size = chunk_budget(sum(p.numel() * p.element_size() for _, _, own in picked for _, p in own))
    aliased = shared(p for group in optimizer.param_groups for p in group["params"])  # with any, chosen or not
    cut = split and elementwise(view)
    groups, flat = [], []
    for group, way, own in picked:
        items: list[FlatRun | Planned] = []
        for name, p in own:
            form = forms.form(p) if way is not None else None
            if form == "flat":
                flat.append(Entry(name, group, p, None, fused=True))
                run = items[-1] if items and isinstance(items[-1], FlatRun) else None
                if run is None:
                    items.append(run := FlatRun())
                run.entries.append(flat[-1])
                continue
            n = slices(p, cut, size // p.element_size())
            clone = _CLONE_VIEW if view is CLONE else _SHARD if id(p) in cloned else None
            fixed = (Route(SKIPPED, INTEGER) if not (p.is_floating_point() or p.is_complex())
                     else None if clone is None else Route(CLONED, clone, n))
            items.append(Planned(name, p, way if form == "whole" else None, id(p) in aliased, n, fixed))
        groups.append((group, items))
    return Plan(key, named, mask, groups, aliased, size, forms.chunks(flat))


_CLONE_VIEW = "no state-aware view for this optimizer's step"
_SHARD = "a shard that the view cannot rebuild"


class Forms(Protocol):
    """What :func:`build` asks of the fused routes."""

    def form(self, p: Tensor) -> str | None:
        """The form they may take ``p`` in: ``"flat"``, ``"whole"`` or None (eager)."""

    def chunks(self, flat: list[Entry]) -> list[Flat]:
        """The entries captured flat, laid into chunks (each entry's ``flat`` set)."""


def assign_slots(blocks: list[FlatRun | Entry], first: int) -> None:
    """Give each parameter of a logging step its consecutive slots of :data:`~monitored_optim.stats.KINDS`
    from ``first`` on, in the order of ``blocks``: runs of flat entries and the lead entry of
    each other parameter. A run that starts at the slot it had on the last logging step keeps its
    entries' slots (given together, the same as now)."""
    width = len(stats.KINDS)
    for block in blocks:
        run = block.entries if isinstance(block, FlatRun) else [block]
        if run[0].slots.get("p") != first:
            for k, e in enumerate(run):
                e.slots = {"p": first + width * k, "grad": first + width * k + 1, "u": first + width * k + 2}
        first += width * len(run)


@dataclass(eq=False)
class Roster:
    """What a logging step's figures read of its entries that the entries' composition alone decides,
    kept while it stays the same (:func:`composition`): per parameter (one per lead entry, in order)
    its name, its slots, its whole shape, the rounding unit of its dtype, the identity of its param
    group; which parameters are in bf16/fp16 (their ``update_lost``) and which were not captured
    flat (their centring decisions are kept for the eager capture).

    Attributes:
        plan: the :class:`Plan` the entries came from.
        composition: :func:`composition` of the entries.
        names: ``N`` parameter names.
        index: int64 ``(N, K)``, each parameter's slot per kind of ``stats.KINDS``.
        shapes: ``N`` ``torch.Size``, each the whole parameter's (under ``torch.distributed``, as the
            :class:`~monitored_optim.distributed.Sharding` knows it: not the shard's).
        dtypes: ``N`` ``torch.dtype``.
        eps: float64 ``(N,)``, :func:`~monitored_optim.capture.rules.eps` of each dtype.
        groups: ``N`` ints, ``id`` of each parameter's param group.
        low: indices of the parameters in bf16/fp16.
        captured: indices of the parameters not captured flat.
        frozen: ``N`` bools, each whether the parameter was frozen on purpose at this logging step (an
            ``nn.Parameter`` with ``requires_grad=False``: no grad by design), :func:`frozen`.
        position: name -> index.
    """

    plan: Plan
    composition: list[tuple[str, bool, bool, tuple[int, ...]]]
    names: list[str]
    index: Tensor
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    eps: Tensor
    groups: list[int]
    low: list[int]
    captured: list[int]
    frozen: list[bool]
    position: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.position = {name: i for i, name in enumerate(self.names)}

    @classmethod
    def of(cls, plan: Plan, composition: list[tuple[str, bool, bool, tuple[int, ...]]], leads: list[Entry],
           shape: Callable[[Tensor], torch.Size] | None = None) -> Roster:
        """The roster of a logging step's ``leads`` (the entries that hold slots), from ``plan``
        (``shape``: the whole parameter's shape of an entry's tensor, where it is a piece)."""
        eps_of = {dtype: machine_eps(dtype) for dtype in {e.p.dtype for e in leads}}
        index = torch.tensor([e.slots[kind] for e in leads for kind in stats.KINDS], dtype=torch.long)
        eps = torch.tensor([eps_of[e.p.dtype] for e in leads], dtype=torch.float64)
        low = [i for i, e in enumerate(leads) if e.p.dtype in LOW_PRECISION]
        return cls(plan, composition, [e.name for e in leads], index.reshape(-1, len(stats.KINDS)),
                   [e.whole.shape if shape is None else shape(e.p) for e in leads], [e.p.dtype for e in leads],
                   eps, [id(e.group) for e in leads], low,
                   [i for i, e in enumerate(leads) if e.flat is None], frozen(leads))


    def joined(self, remote: list[Remote], names: list[str] | None = None) -> Roster:
        """This roster with the parameters that other ranks monitor after its own (a pipeline's other
        stages: their figures, not their capture), each with a ``name``, ``shape`` and ``dtype`` (its
        name in ``torch``, as ``"torch.bfloat16"``); no param group of this rank's is theirs.
        ``names``: every parameter's name, where the ranks renamed some (kept apart)."""
        if names is not None and names[:len(self.names)] != self.names:
            return dataclasses.replace(self, names=names[:len(self.names)]).joined(remote)
        if not remote:
            return self
        dtypes = [getattr(torch, r.dtype.removeprefix("torch.")) for r in remote]
        start = len(self.names)
        return Roster(self.plan, self.composition, self.names + [r.name for r in remote], self.index,
                      self.shapes + [torch.Size(r.shape) for r in remote], self.dtypes + dtypes,
                      torch.cat([self.eps, torch.tensor([machine_eps(d) for d in dtypes], dtype=torch.float64)]),
                      self.groups + [0] * len(remote),
                      self.low + [start + i for i, d in enumerate(dtypes) if d in LOW_PRECISION], self.captured,
                      self.frozen + [False] * len(remote))


def frozen(leads: list[Entry]) -> list[bool]:
    """Per parameter (its lead entry), whether it is frozen on purpose now: an ``nn.Parameter`` whose
    ``requires_grad`` is False (a flat buffer or shard an engine made is not one)."""
    return [isinstance(e.whole, torch.nn.Parameter) and not e.whole.requires_grad for e in leads]


def composition(entries: list[Entry]) -> list[tuple[str, bool, bool, tuple[int, ...]]]:
    """What decides a logging step's :class:`Roster` beyond its plan: per entry not captured flat (a
    flat one is the plan's own), its name, whether it leads its parameter's parts, whether the
    fused capture takes it, and its slots (a step with a closure gives the eager capture's grads
    slots of their own; the flat runs' slots follow from the rest)."""
    return [(e.name, e.lead is None, e.fused, tuple(e.slots.values())) for e in entries if e.flat is None]

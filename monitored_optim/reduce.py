"""The reduce stage: a logging step's values on the host, the moment table of its parameters and their pieces.

One row per monitored parameter: the ``(mean, m2)`` of each kind of :data:`~monitored_optim.stats.KINDS`
(p_before, grad, u) as they come back from the device in one copy (or from the one collective,
:mod:`monitored_optim.distributed`), with every figure's arithmetic done for the whole table at once
(:class:`MomentTable`), and the host values of the other pieces (:mod:`monitored_optim.pieces`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .stats import CENTRE_ABOVE, KINDS, RELIABLE_BELOW, Moments

if TYPE_CHECKING:
    from .capture.plan import Entries, Entry, Roster
    from .distributed import Sharding, Unsharded
    from .pieces import Keys
    from .distributed.pipeline import Ranks
    from .distributed.table import Reduced


@dataclass(frozen=True)
class Hosted:
    """A logging step's values on the host, one row per monitored parameter: the moments of its
    :data:`~monitored_optim.stats.KINDS` and the host values of its other pieces (``{key: [floats]}``:
    ``exact``, ``lost``, ``verify`` and the families')."""

    table: MomentTable
    pieces: list[dict[str, list[float]]]

    def head(self, rows: int) -> Hosted:
        """The first ``rows`` parameters' values (a rank's own, before those other ranks monitor)."""
        t = self.table
        return Hosted(MomentTable(t.n[:rows], t.mean[:rows], t.m2[:rows],
                                  None if t.uncentred is None else t.uncentred[:rows],
                                  None if t.present is None else t.present[:rows]), self.pieces[:rows])


@dataclass(frozen=True)
class MomentTable:
    """Host-side moments of N tensors of K kinds each (a logging step: p, grad, u per parameter).

    Every property is computed for the whole table at once, and once per table (float64 CPU tensors,
    a few ops in all instead of a few Python calls per tensor; a table is not changed once made),
    with ``std = sqrt(m2 / (n - 1))`` (correction=1, as ``torch.std``) and
    ``||x||_2 = sqrt(m2 + n * mean^2)``.

    Attributes:
        n: shape ``(N, 1)``, element counts (float64; 0 for an empty tensor).
        mean: shape ``(N, K)``, float64 means.
        m2: shape ``(N, K)``, float64 sums of squared deviations from the mean.
        uncentred: bool ``(N, K)``, moments that came from uncentred float32 sums (None: none did).
        present: bool ``(N, K)``, the kinds that had values (a parameter with no grad, or no update,
            has zeros there); None: all did. Read as :attr:`has`.
    """

    n: Tensor
    mean: Tensor
    m2: Tensor
    uncentred: Tensor | None = None
    present: Tensor | None = None
    _ratios: dict[tuple[int, int], Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    @functools.cached_property
    def std(self) -> Tensor:
        """Sample standard deviations (correction=1), shape ``(N, K)``.

        NaN where ``n < 2``, and where uncentred sums had a mean too large for their spread
        (``mean^2 > RELIABLE_BELOW * var``: the float32 rounding of the sums, about 1e-7 * mean^2 / var
        of the variance, would show)."""
        std = torch.where(self.n > 1, (self.m2.clamp(min=0) / (self.n - 1)).sqrt(), math.nan)
        return std if self.uncentred is None else torch.where(self.coarse, math.nan, std)

    @functools.cached_property
    def coarse(self) -> Tensor:
        """Bool ``(N, K)``: uncentred sums whose mean is too large for their spread to be told
        (``mean^2 > RELIABLE_BELOW * var``); such a std is withheld, and the next logging step takes
        the centred pass (:attr:`needs_centring`)."""
        if self.uncentred is None:
            return torch.zeros_like(self.mean, dtype=torch.bool)
        return self.uncentred & (self.n > 1) & (self.mean.square() > RELIABLE_BELOW * self.var)

    @functools.cached_property
    def has(self) -> Tensor:
        """Bool ``(N, K)``: :attr:`present`, all True where it is None."""
        return self.present if self.present is not None else torch.ones_like(self.mean, dtype=torch.bool)

    @functools.cached_property
    def var(self) -> Tensor:
        """Population variances ``m2 / n``, shape ``(N, K)`` (0 for an empty tensor)."""
        return self.m2 / self.n.clamp(min=1)

    @functools.cached_property
    def norm(self) -> Tensor:
        """L2 norms, shape ``(N, K)`` (0 for an empty tensor)."""
        return self.sq_norm.sqrt()

    @functools.cached_property
    def sq_norm(self) -> Tensor:
        """Squared L2 norms ``m2 + n * mean^2``, shape ``(N, K)`` (0 for an empty tensor)."""
        return torch.where(self.n > 0, self.m2.clamp(min=0) + self.n * self.mean.square(), 0.0)

    @functools.cached_property
    def finite(self) -> Tensor:
        """Bool ``(N, K)``: mean and m2 finite (False iff some element was NaN or Inf)."""
        return self.mean.isfinite() & self.m2.isfinite()

    @functools.cached_property
    def all_zero(self) -> Tensor:
        """Bool ``(N, K)``: every element exactly zero. The sums run in float32, so tensors whose
        every element is below about 1e-19 in magnitude (squares under float32's smallest normal)
        also read as zero; no optimizer step is that small in practice."""
        return (self.mean == 0) & (self.m2 == 0)

    @functools.cached_property
    def needs_centring(self) -> Tensor:
        """Bool ``(N, K)``: take the centred pass next time (``mean^2 > CENTRE_ABOVE * var``, see
        :func:`~monitored_optim.stats._centred`); True for undefined or non-finite moments and for zero spread (a
        zero-initialised bias may move as one)."""
        var = self.var
        defined = self.mean.isfinite() & var.isfinite()
        return ~defined | (var <= 0) | (self.mean.square() > CENTRE_ABOVE * var)

    def log10_ratio(self, num: int, den: int) -> Tensor:
        """``log10(std[:, num] / std[:, den])``, shape ``(N,)``; NaN where either std is zero,
        undefined or not finite (such a ratio is not logged). Computed once per pair of kinds."""
        ratio = self._ratios.get((num, den))
        if ratio is None:
            ratio = self._ratios[num, den] = self._log10_ratio(num, den)
        return ratio

    def _log10_ratio(self, num: int, den: int) -> Tensor:
        std = self.std
        a, b = std[:, num], std[:, den]
        ok = a.isfinite() & b.isfinite() & (a > 0) & (b > 0)
        return torch.where(ok, (a / b).log10(), math.nan)



def pieces(entries: list[Entry], holding: list[int], values: list[list[float]]
                 ) -> list[dict[str, list[float]]]:
    """Per entry, its pieces' host values, from ``values`` in the order of their pieces.

    Only the entries at the indices ``holding`` have any; the others get an empty dict."""
    it = iter(values)
    own: list[dict[str, list[float]]] = [{} for _ in range(len(entries))]
    for i in holding:
        own[i] = {key: next(it) for key in entries[i].pieces}
    return own


def table(entries: list[Entry], captured: list[int], counts: Tensor | list[float], pairs: Tensor,
                  present: Tensor) -> MomentTable:
    """The host moments of a logging step as one table: ``counts``, the entries' element counts;
    ``pairs``, float64 ``(N, K, 2)`` of ``(mean, m2)`` per kind of :data:`~monitored_optim.stats.KINDS`,
    zeros where ``present`` (bool ``(N, K)``) says a kind had no values (no grad; no update: the
    parameter did not move); ``captured``: the indices of the entries not captured flat (only the
    eager capture's may be uncentred)."""
    uncentred = None  # every entry centred (the fused capture's); other ranks' parameters after them
    if any(entries[i].centred for i in captured):
        flags = [not e.centred.get(kind, True) for e in entries for kind in KINDS]
        flags += [False] * (len(counts) - len(entries)) * len(KINDS)
        uncentred = torch.tensor(flags, dtype=torch.bool).reshape(len(counts), len(KINDS))
    n = torch.as_tensor(counts, dtype=torch.float64).reshape(-1, 1)
    return MomentTable(n, pairs[..., 0], pairs[..., 1], uncentred, present)


def gather(entries: Entries, roster: Roster, rows: Moments, lr_values: dict[int, Tensor],
           sharding: Sharding | Unsharded, keys: Keys | None = None, ranks: Ranks | None = None,
           cost: tuple[float, float] = (0.0, 0.0)) -> tuple[Hosted, list[list[float]], Reduced | None]:
    """A logging step's values on the host: one device-to-host copy per device, or under
    ``torch.distributed`` one all_reduce (and one host copy for Tensor learning rates).

    Args:
        entries, roster: the step's entries and parameters.
        rows: the batch's moments (:meth:`~monitored_optim.stats.Batch.finish`).
        lr_values: id -> the Tensor learning rates to read.
        sharding: the step's layout (:func:`~monitored_optim.distributed.sharding`).
        keys, ranks, cost: under ``torch.distributed``, every piece key ->
            its reduction (the table's rows), the union of names and this rank's
            ``(bytes copied, host seconds)`` (:func:`~monitored_optim.distributed.table.reduce`).

    Returns:
        ``(hosted, read, reduced)``: the step's :class:`Hosted` (under ``torch.distributed`` over the
        union of the ranks' parameters, this rank's first), each Tensor lr's value (``[floats]``), and
        the reduction (None outside ``torch.distributed``).
    """
    leads = entries.leads
    if not sharding.sharded:  # one process: its own values, one copy
        holding = [i for i, e in enumerate(leads) if e.pieces]  # a flat entry's: its histograms, if any
        held = [piece for i in holding for piece in leads[i].pieces.values()]
        index = roster.index
        pairs, present, extra = rows.host(index, held + list(lr_values.values()))
        counts = rows.sizes[index[:, 0]]  # p_before's rows cover each parameter once
        own, read = pieces(leads, holding, extra[:len(held)]), extra[len(held):]
        return Hosted(table(leads, roster.captured, counts, pairs, present), own), read, None
    for e in leads:  # whole-parameter values and counts
        e.pieces.update({kind: row for kind, slot in e.slots.items() if (row := rows[slot]) is not None})
    assert keys is not None and ranks is not None  # given with the sharding
    reduced = sharding.reduce(leads, keys, ranks, cost)
    empty = torch.zeros(0, dtype=torch.long)
    read = Moments({}, {}, 0, torch.zeros(0)).host(empty, list(lr_values.values()))[2]
    return Hosted(table(leads, roster.captured, reduced.counts, reduced.pairs, reduced.present), reduced.pieces), \
        read, reduced


class CentringMemory:
    """Which moments of each parameter take the centred pass at its next eager capture.

    A parameter not measured before takes it for every kind of :data:`~monitored_optim.stats.KINDS`.
    After a logging step, :meth:`update` keeps :attr:`MomentTable.needs_centring` of the parameters the eager capture
    may take next time (a grad's flag stays where the step had no grad); a parameter captured flat is
    exact for any spread and keeps none (:meth:`forget`).
    """

    FIRST = (True, True, True)
    """The flags, per kind of :data:`~monitored_optim.stats.KINDS`, of a parameter not measured before."""

    def __init__(self) -> None:
        self._flags: dict[str, Sequence[bool]] = {}

    def flags(self, names: Iterable[str], kind: str) -> list[bool]:
        """Per name, whether its ``kind`` moments take the centred pass."""
        k = KINDS.index(kind)
        return [self._flags.get(name, self.FIRST)[k] for name in names]

    def forget(self, names: Iterable[str]) -> None:
        """Drop the flags of ``names`` (captured flat: should one leave that capture, it starts centred)."""
        for name in names:
            self._flags.pop(name, None)

    def update(self, names: list[str], rows: list[int], table: MomentTable) -> None:
        """Keep the flags of the parameters at ``rows`` of ``table`` that had elements."""
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long)
        flags, grads, sizes = (table.needs_centring[index].tolist(), table.has[index, 1].tolist(),
                               table.n[index, 0].tolist())
        held = self._flags
        held.update({names[i]: flag if grad else [flag[0], held.get(names[i], self.FIRST)[1], flag[2]]
                     for i, flag, grad, size in zip(rows, flags, grads, sizes) if size})

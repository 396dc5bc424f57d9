"""The reduce stage: a logging step's values brought to the host, in one copy or one collective.

One row per monitored parameter: the ``(mean, m2)`` of each kind of :data:`~monitored_optim.stats.KINDS`
(p_before, grad, u) as they come back from the device in one copy (or from the one collective,
:mod:`monitored_optim.distributed`), made into a :class:`~monitored_optim.hosted.MomentTable`, and the
host values of the other pieces (:mod:`monitored_optim.pieces`), as a :class:`~monitored_optim.hosted.Hosted`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .hosted import Hosted, MomentTable
from .stats import KINDS, Moments

if TYPE_CHECKING:
    from .capture.plan import Entries, Entry, Roster
    from .distributed import Sharding, Unsharded
    from .pieces import Keys
    from .distributed.pipeline import Ranks
    from .distributed.table import Reduced


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

"""The one collective of a sharded logging step: every rank's pieces in one float64 table.

Each rank turns the pieces of what it holds of each parameter into weighted sums, by the pieces'
declared reductions (:mod:`monitored_optim.pieces`): a parameter's moments ``(mean, m2)`` over its
local n elements become the weighted power sums

    (w·n, w·Σx, w·Σx²),   Σx = n·mean,   Σx² = m2 + n·mean²,

a SUM or WHOLE piece ``w·c``, a NORM piece the squares ``w·a²``; ``w`` is the piece's weight
(:meth:`~.held.Held.weight`), so that every element counts once over the world. A least or
greatest value (MIN, MAX) does not add: each rank writes its own in a slot of its own, one per rank
of the world, and every other rank a zero there, so that the sum is every rank's value; the host
takes the least or the greatest (a rank without one, or whose piece weighs 0, leaves the identity
of the reduction, ±inf). One ``all_reduce(SUM)`` adds the tables, one copy brings the result to
the host, and for the whole
parameter of N elements ``mean = Σx / N``, ``m2 = Σx² - Σx·mean`` (Chan, Golub & LeVeque 1979, in
power-sum form). Precision: the float64 cancellation costs ``~1e-16·(mean/std)²`` of m2 (1e-8 for
a LayerNorm weight near 1.0 with std 1e-4); the float32 rounding δ of each shard's mean costs
``~2·δ·Δμ/std²`` (Δμ the gap between the shards' means), ~1e-5 of m2 for that weight on
256-element shards.

The table has a block of rows per parameter of the union of the ranks' names
(:class:`~.pipeline.Ranks`), in the same order on every rank; a rank fills the blocks of the
parameters it monitors and leaves the others at zero. Two header rows carry a checksum of the
union, a failure flag (a rank that failed to build its part still joins the collective, so that
the failure is raised on every rank instead of a hang) and a flag for a rank whose names changed
since the last exchange (then every rank exchanges again and reduces once more, on that step only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .. import stats
from ..pieces import MAX, MIN, MOMENTS, NORM, SUM, WHOLE, Keys
from .held import Held
from .pipeline import Ranks, Remote

COLUMNS, HEADER = 4, 2
"""Table columns, and rows before the first parameter's block."""

CODE = {MOMENTS: 0.0, SUM: 1.0, WHOLE: 1.0, NORM: 2.0}
"""Each reduction's code in the table build (SUM and WHOLE sum alike; MIN and MAX have slots, :func:`rows`)."""

SLOTTED = (MIN, MAX)
"""The reductions that do not add: a slot per rank, each holding one rank's value (a MIN one negated,
so that every slot's greatest value is the answer and -inf says none)."""


@dataclass
class Gathered:
    """A logging step's values on the host, per parameter (this rank's first, then those other ranks
    monitor): what :meth:`Sharding.reduce <monitored_optim.distributed.Sharding.reduce>` and
    :meth:`Unsharded.reduce <monitored_optim.distributed.Unsharded.reduce>` both answer.

    Attributes:
        counts: per parameter N, its element count (over the ranks: a float holding an integer).
        pairs: float64 ``(P, 3, 2)``, the ``(mean, m2)`` of each kind of :data:`~monitored_optim.stats.KINDS`
            over all N elements (a kind missing on a rank counts as zeros there; zeros where none had it).
        present: bool ``(P, 3)``, whether some rank had each kind.
        pieces: per parameter the host values of its other pieces (``[count]``, ``[norm, norm]``).
        read: each Tensor learning rate's value (``[floats]``), in the order given.
        remote: the parameters after this rank's own (:class:`~.pipeline.Remote`), monitored elsewhere
            (none in one process).
        names: per parameter its name in the union (this rank's own may be kept apart from another
            rank's parameter of the same name, :class:`~.pipeline.Ranks`); None: the roster's own.
        cost: the ``monitor`` family over the ranks, ``(bytes all ranks copied, their mean host
            seconds)``; None: this process's own.
    """

    counts: Tensor | list[float]
    pairs: Tensor
    present: Tensor
    pieces: list[dict[str, list[float]]]
    read: list[list[float]] = field(default_factory=list)
    remote: list[Remote] = field(default_factory=list)
    names: list[str] | None = None
    cost: tuple[float, float] | None = None


def gathered(host: list[list[float]], ranks: Ranks, keys: Keys, world: int,
             cost: tuple[float, float] = (0.0, 0.0)) -> Gathered:
    """The :class:`Gathered` values of the reduced table ``host`` (its rows as lists), per parameter of
    the union ``ranks``, in a world of ``world``; ``cost`` as the header summed it."""
    counts: list[float] = []
    pairs, present, pieces = [], [], []
    for name in ranks.names:
        n, got = _hosted(host, ranks.block[name], keys, world)
        counts.append(n)
        pairs += [got.get(kind, [0.0, 0.0]) for kind in stats.KINDS]
        present += [kind in got for kind in stats.KINDS]
        pieces.append({key: value for key, value in got.items() if key not in stats.KINDS})
    shape = (len(ranks.names), len(stats.KINDS))
    return Gathered(counts, torch.tensor(pairs, dtype=torch.float64).reshape(*shape, 2),
                    torch.tensor(present, dtype=torch.bool).reshape(shape), pieces,
                    remote=list(ranks.remote), names=list(ranks.names), cost=cost)


class Captured(Protocol):
    """A captured parameter's record, as a layout reduces it (:class:`~monitored_optim.capture.plan.Entry`):
    its name, the local tensor read, its batch slots per kind and its device pieces."""

    name: str
    p: Tensor
    slots: dict[str, int]
    pieces: dict[str, Any]

    @property
    def whole(self) -> Tensor: ...


def reduce(entries: Sequence[Captured], local: list[Remote], held: list[Held], keys: Keys, ranks: Ranks,
           left_out: set[str], cost: tuple[float, float] = (0.0, 0.0)) -> Gathered:
    """Every entry's pieces summed over the ranks: ONE ``all_reduce`` (SUM) of one float64 table,
    then one device-to-host copy (two of each on a step where a rank's names changed).

    Args:
        entries: this rank's entries, one per parameter; each has ``.name``, ``.p`` (its local
            tensor) and ``.pieces``, float64 device tensors from the local tensor: ``"p"``,
            ``"grad"``, ``"u"`` (``(mean, m2)``, shape ``(2,)``), counts and sums (shape ``(1,)``),
            norms (shape ``(k,)``); a piece may be missing on a rank.
        local: per entry, its name, whole shape and dtype (what the other ranks learn of it).
        held: per entry, what this rank holds of it (its weight, whether it is split: a split
            parameter's WHOLE pieces are left out).
        keys: every key a piece may have -> its reduction, the same on every rank: a block's rows.
        ranks: the union of names, exchanged here at the first call and when names change.
        left_out: where the keys of pieces left out are added.
        cost: this rank's ``(bytes copied, host seconds)`` so far (the ``monitor`` family), summed in
            the header: ``Gathered.cost`` holds the bytes of all ranks and their mean seconds.

    Raises:
        RuntimeError: a rank failed to build its part of the table (raised on every rank after the
            collective, so that none hangs), or the ranks' unions differ.
    """
    if ranks.local is None:
        ranks.exchange(local)
    world, rank, device = dist.get_world_size(), dist.get_rank(), collective_device()
    for attempt in range(2):
        changed = tuple(r.name for r in local) != ranks.local
        local_error: Exception | None = None
        try:
            table = build(entries, held, keys, ranks, changed, left_out, cost, world, rank, device)
        except Exception as err:  # join the collective anyway: a rank that skips it hangs the job
            local_error = err
            table = _empty(keys, len(ranks.block), ranks.fingerprint, device, changed, cost, world, rank)
            table[0, 3] = 1.0
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
        host = table.tolist() if table.device.type == "cpu" else table.cpu().tolist()
        (count, f_sum, f_sq, failed), (changes, copied, seconds, _) = host[0], host[1]
        if failed:
            here = f" (this rank: {type(local_error).__name__}: {local_error})" if local_error else ""
            raise RuntimeError(f"monitored_optim: {int(failed)} rank(s) could not reduce their figures{here}") \
                from local_error
        if changes and not attempt:
            ranks.exchange(local)  # every rank saw the flag: every rank exchanges
            continue
        f = ranks.fingerprint
        if changes or count != world or f_sum != count * f or f_sq != count * f * f:
            raise RuntimeError(
                "monitored_optim: the ranks of the default process group disagree on the parameters they "
                "monitor, so figures cannot be combined. Every rank must step its monitored optimizer on the "
                "same steps, with names that mean the same parameter on every rank that holds it.")
        return gathered(host, ranks, keys, world, (copied, seconds / count))
    raise AssertionError("unreachable")


def build(entries: Sequence[Captured], held: list[Held], keys: Keys, ranks: Ranks, changed: bool, left_out: set[str],
          cost: tuple[float, float], world: int, rank: int, device: torch.device) -> Tensor:
    """Rank ``rank``'s table in a world of ``world`` (no collective: the world's tables sum to the reduction).

    Shape ``(HEADER + K·P, 4)`` float64 (K rows per parameter, :func:`rows`; P parameters in the union), on its
    pieces' device, else ``device``. Row 0: ``(1, f, f², failed)``; row 1: ``(changed, bytes copied, host seconds,
    0)``. Per parameter block b, from row ``HEADER + Kb``, the keys' rows in order, columns by reduction: MOMENTS
    ``(w·n, w·Σx, w·Σx², present)``, SUM and WHOLE ``(w·c, 0, 0, present)`` (a wide SUM piece ``(w·c_3j, w·c_3j+1,
    w·c_3j+2, present)`` in its j-th row), NORM ``(w·a², w·b², 0, present)``; ``present`` is 1 where the rank had
    the piece (unweighted); a MIN or MAX piece the value (MIN: negated) in this rank's slot r of its rows (row ``r
    // 3``, column ``r % 3``), -inf there where it has none or its piece weighs 0, zeros in the other ranks' slots.
    A rank whose names ``changed`` since the exchange sends only its header (and its -inf slots). The other
    arguments as :func:`reduce`'s."""
    at, per = rows(keys, world)
    values, meta, wide, wide_meta = [], [], [], []  # meta per piece: (table row, w·n, w, n > 0, reduction code)
    slotted, slots = [], []  # MIN and MAX pieces, and each one's (row, column)
    for e, h in zip(entries, held):
        key = ranks.key.get(e.name)
        if key is None or changed:
            continue
        block, w, n = ranks.block[key], h.weight(ranks.holders[key]), float(stats.count(e.p))
        for key, value in e.pieces.items():
            how = keys.get(key)
            if how is None or (how == WHOLE and h.split):
                left_out.add(key)
                continue
            row = HEADER + per * block + at[key]
            if how in SLOTTED:
                if w > 0:  # a piece that does not count (a ZeRO non-owner's) keeps the -inf of none
                    slotted.append(value.reshape(1).to(torch.float64) * (-1.0 if how == MIN else 1.0))
                    slots.append((row + rank // 3, rank % 3))
                continue
            if keys.width(key) > 1:  # a wide SUM piece: three values a row
                wide.append(value.reshape(-1))
                wide_meta.append((row, keys.width(key), w))
                continue
            values.append(value.reshape(-1))
            meta.append((row, w * n, w, float(n > 0), CODE[how]))
    device = next((v[0].device for v in (values, wide, slotted) if v), None) or device
    table = _empty(keys, len(ranks.block), ranks.fingerprint, device, changed, cost, world, rank)
    if wide:
        _put_wide(table, wide, wide_meta)
    if slotted:
        slot_rows, slot_columns = torch.tensor(slots, dtype=torch.long).to(device).unbind(1)
        table.index_put_((slot_rows, slot_columns), torch.cat(slotted).to(device))
    if not values:
        return table
    x = torch.stack([torch.nn.functional.pad(v.to(device=device, dtype=torch.float64), (0, 2 - v.numel()))
                     for v in values])
    at_rows, wn, ws, nonempty, kind = torch.tensor(meta, dtype=torch.float64).to(device).unbind(1)
    a, b = x.unbind(1)
    zero = torch.zeros_like(wn)
    w_sum = torch.where(nonempty > 0, wn * a, zero)  # moments: a = mean, b = m2 (NaN mean if empty)
    moments = torch.stack([wn, w_sum, torch.where(nonempty > 0, ws * b + w_sum * a, zero)], 1)
    count = torch.stack([ws * a, zero, zero], 1)
    norms = torch.stack([ws * a.square(), ws * b.square(), zero], 1)
    k = kind.unsqueeze(1)
    sums = torch.where(k == CODE[MOMENTS], moments, torch.where(k == CODE[NORM], norms, count))
    table.index_copy_(0, at_rows.long(), torch.cat([sums, torch.ones_like(wn).unsqueeze(1)], 1))
    return table


def rows(keys: Keys, world: int) -> tuple[dict[str, int], int]:
    """Each key's first row in a parameter's block, and the rows of a block: a key of width k takes
    ``ceil(k / 3)`` rows, three values a row, a MIN or MAX key ``ceil(world / 3)``, a slot per rank
    (every other key one)."""
    at, n = {}, 0
    for key, how in keys.items():
        at[key] = n
        n += -(-_width(keys, key, how, world) // 3)
    return at, n


def _width(keys: Keys, key: str, how: str, world: int) -> int:
    """The values a parameter's block holds of ``key``: a slot per rank for MIN and MAX, else its width."""
    return world if how in SLOTTED else keys.width(key)


def _put_wide(table: Tensor, values: list[Tensor], meta: list[tuple[int, int, float]]) -> None:
    """Write wide SUM pieces into ``table``: each ``(first row, width, weight)`` of ``meta`` takes
    ``ceil(width / 3)`` rows of ``w·value`` three values a row, its present column 1."""
    blocks: list[Tensor] = []
    index: list[int] = []
    for value, (row, width, w) in zip(values, meta):
        n = -(-width // 3)
        padded = torch.nn.functional.pad(value.to(device=table.device, dtype=torch.float64), (0, 3 * n - value.numel()))
        blocks.append(torch.cat([w * padded.reshape(n, 3), torch.ones(n, 1, dtype=torch.float64, device=table.device)],
                                1))
        index += range(row, row + n)
    table.index_copy_(0, torch.tensor(index, dtype=torch.long).to(table.device), torch.cat(blocks))


def _empty(keys: Keys, blocks: int, fingerprint: float, device: torch.device, changed: bool,
           cost: tuple[float, float], world: int, rank: int) -> Tensor:
    """A table of ``blocks`` parameter blocks (:func:`rows`) after the two header rows, zeros but
    the header and rank ``rank``'s -inf in its slot of every MIN and MAX key of every block (none yet)."""
    at, per = rows(keys, world)
    table = torch.zeros(HEADER + blocks * per, COLUMNS, dtype=torch.float64, device=device)
    table[:HEADER, :3] = torch.tensor([[1.0, fingerprint, fingerprint * fingerprint], [float(changed), *cost]],
                                      dtype=torch.float64)
    own = [at[key] + rank // 3 for key, how in keys.items() if how in SLOTTED]
    if own and blocks:
        at_rows = (HEADER + per * torch.arange(blocks).unsqueeze(1) + torch.tensor(own)).reshape(-1).to(device)
        table[at_rows, rank % 3] = -math.inf
    return table


def _hosted(host: list[list[float]], block: int, keys: Keys, world: int) -> tuple[float, dict[str, list[float]]]:
    """``(n, got)`` of one parameter's block of the reduced host table: its element count and its
    value of every piece that some rank had (a NORM piece: its two norms; a wide SUM piece: its
    ``width`` values; a MIN or MAX piece: the least or greatest of the ranks' slots)."""
    at, per = rows(keys, world)
    own = host[HEADER + per * block: HEADER + per * (block + 1)]
    n = float(round(own[0][0]))  # the first key is "p", whose w·n sum over ranks is N
    got: dict[str, list[float]] = {}
    for key, how in keys.items():
        if how in SLOTTED:
            best = max([x for row in own[at[key]:at[key] - (-world // 3)] for x in row[:3]][:world])
            if best != -math.inf:
                got[key] = [-best if how == MIN else best]
            continue
        a, b, c, present = own[at[key]]
        if not present:
            continue
        if keys.width(key) > 1:
            got[key] = [x for row in own[at[key]:at[key] - (-keys.width(key) // 3)] for x in row[:3]][:keys.width(key)]
        elif how == MOMENTS:
            mean = b / n if n > 0 else 0.0
            got[key] = [mean, max(c - b * mean, 0.0)] if n > 0 else [0.0, 0.0]
        elif how == NORM:
            got[key] = [math.sqrt(max(a, 0.0)), math.sqrt(max(b, 0.0))]
        else:
            got[key] = [a]
    return n, got


def collective_device() -> torch.device:
    """Where a collective's tensor lives (the table of a rank with no moment rows, the guard's decision):
    the accelerator for NCCL-like backends, else the CPU."""
    backend = str(dist.get_backend()).lower()
    if "gloo" not in backend and "mpi" not in backend and torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        assert acc is not None  # is_available()
        return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cpu")

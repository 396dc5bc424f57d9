"""The capture's binning: a logging step's parts, flat chunks and compiled calls into histogram pieces.

The bins are :mod:`monitored_optim.histograms`', and the rule that gives an element its bin from its
bits is :mod:`monitored_optim.capture.bits`'; here is how the capture applies them at a logging step:

* the eager capture's parts: a :class:`Tally` counts each part's keys and folds them at once per
  step, adding the parts of each parameter;
* the flat chunks: :func:`segment_values` bins each chunk's tensors in one pass, per member
  (:func:`bin_flat`);
* the compiled routes: :func:`binned` (traced into the fused passes: each element's bin by
  :func:`element_bins`) and :func:`counted_bins` after them (:func:`bin_whole`).

Each ends as a parameter's pieces (:data:`~monitored_optim.histograms.PIECES`), handed to the entry
that holds them.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol, Union

import torch
from torch import Tensor

from ..histograms import KEYS, NBINS, WIDTH, ZERO, piece_keys
from ..workspace import PART_ELEMENTS
from ..workspace import Workspace
from .bits import BITS, finite_ends, flattened, fold, folded, keys_counted, occurrences, steps
from .change import exact_change

if TYPE_CHECKING:
    from .plan import Entry, Flat


class Owner(Protocol):
    """What holds a parameter's pieces: its lead entry (:attr:`~monitored_optim.capture.plan.Entry.owner`)."""

    pieces: dict[str, Tensor]


class Tally:
    """The histograms of one logging step's parts of parameters, counted part by part and folded at once.

    A part's tensor may be a temporary that the next part reuses, so :meth:`add` takes its keys'
    counts, its ends and its sums when it is given (a dozen ops per part); :meth:`pieces` then folds
    the counts of every part into the bins and adds them over the parts of each parameter with a few
    ops per device for the whole step. The parts are keyed by their *owner* (the entry that holds a
    parameter's pieces) and series.
    """

    def __init__(self) -> None:
        self._step: weakref.ref[object] | None = None  # a weak reference to the logging step's batch
        self._owners: dict[tuple[int, str], tuple[tuple[Owner, str], list[_Part]]] = {}

    def open(self, step: object) -> None:
        """Count into the logging step ``step`` (its batch): the parts of another one are dropped (a
        logging step whose base step raised never reaches :meth:`pieces`)."""
        if self._step is None or self._step() is not step:
            self._step, self._owners = weakref.ref(step), {}

    def add(self, owner: Owner, series: str, x: Tensor, scale: Tensor | None = None,
            work: Workspace | None = None) -> None:
        """Count one part ``x`` of ``owner``'s tensor under ``series`` (arguments as
        :func:`~monitored_optim.capture.bits.counts`')."""
        flat = flattened(x, scale)
        ends = finite_ends(flat)
        table, counts = keys_counted(flat, ends is not None, work)
        if ends is None:
            low, high, sums = _masked_extent(flat, work)
            self._part(owner, series, table, counts, torch.cat([low, high]), sums)
        else:
            self._part(owner, series, table, counts, ends, _sums(flat, work))

    def add_zeros(self, owner: Owner, series: str, x: Tensor) -> None:
        """Count the change of a part ``x`` that the view says did not move: x - x, an exact zero for
        each finite element of ``x`` (NaN for a non-finite one, not binned)."""
        flat = flattened(x, None)
        n = torch.isfinite(flat).sum()
        table = fold(torch.float32, flat.device, True)
        counts = torch.zeros(len(table), dtype=torch.int64, device=flat.device)
        counts[0] = n  # +0.0's key
        ends = torch.where(n > 0, torch.zeros(2, dtype=torch.float64, device=flat.device),
                           torch.tensor([math.inf, -math.inf], dtype=torch.float64, device=flat.device))
        self._part(owner, series, table, counts, ends, torch.zeros(2, dtype=torch.float64, device=flat.device))

    def drop(self, owner: Owner, series: str) -> None:
        """Forget the parts counted of ``owner``'s tensor under ``series`` (its grads, made again by a closure)."""
        self._owners.pop((id(owner), series), None)

    def pieces(self) -> list[tuple[Owner, dict[str, Tensor]]]:
        """Per owner and series counted, ``(owner, its pieces of the series by key of PIECES)``: the
        counts, extremes and sums of its parts added. The tally is then empty."""
        owners, self._owners = list(self._owners.values()), {}
        parts = [(g, part) for g, (_, counted) in enumerate(owners) for part in counted]
        out = []
        for device in dict.fromkeys(part.counts.device for _, part in parts):
            tables: dict[int, tuple[Tensor, list[tuple[int, _Part]]]] = {}  # by fold table: folded at once
            for g, part in parts:
                if part.counts.device == device:
                    tables.setdefault(id(part.table), (part.table, []))[1].append((g, part))
            mine = [item for _, items in tables.values() for item in items]
            local = {g: i for i, g in enumerate(dict.fromkeys(g for g, _ in mine))}
            index = torch.tensor([local[g] for g, _ in mine], device=device)
            n = len(local)
            bins = [folded(torch.stack([part.counts for _, part in items]), table) for table, items in tables.values()]
            rows = torch.cat([torch.cat(bins), _pairs([part.sums for _, part in mine], device)], 1)
            summed = torch.zeros(n, WIDTH, dtype=torch.float64, device=device).index_add_(0, index, rows)
            ends = _pairs([part.ends for _, part in mine], device)
            inf = torch.full((n,), math.inf, dtype=torch.float64, device=device)
            low = inf.scatter_reduce(0, index, ends[:, 0], "amin").unsqueeze(1)
            high = (-inf).scatter_reduce(0, index, ends[:, 1], "amax").unsqueeze(1)
            for (g, _), values in zip(local.items(), zip(summed.unbind(), low.unbind(), high.unbind())):
                owner, series = owners[g][0]
                out.append((owner, dict(zip(piece_keys(series), values))))
        return out

    def _part(self, owner: Owner, series: str, table: Tensor, counts: Tensor, ends: Pair, sums: Pair) -> None:
        """Keep one part's counts of its keys (of ``table``), its ends ``(min, max)`` and its sums."""
        self._owners.setdefault((id(owner), series), ((owner, series), []))[1].append(_Part(table, counts, ends, sums))


Pair = Union[Tensor, tuple[float, float]]
"""Two float64 values: a tensor of shape ``(2,)`` on a part's device, or, read already, two floats."""


class _Part(NamedTuple):
    """One part's tally: its keys' counts (int64, one per key of its fold ``table``), the ``(min, max)``
    and ``(Σx, Σx²)`` of its finite elements."""

    table: Tensor
    counts: Tensor
    ends: Pair
    sums: Pair


def _pairs(pairs: list[Pair], device: torch.device) -> Tensor:
    """``pairs`` as the rows of a float64 ``(k, 2)`` tensor on ``device``."""
    if all(isinstance(pair, tuple) for pair in pairs):
        return torch.tensor(pairs, dtype=torch.float64, device=device)
    return torch.stack([torch.as_tensor(pair, dtype=torch.float64, device=device) for pair in pairs])


def _masked_extent(flat: Tensor, work: Workspace | None) -> tuple[Tensor, Tensor, Tensor]:
    """The min, max and ``(Σx, Σx²)`` of the finite elements of a 1-D tensor (any), float64 on its
    device, the non-finite elements masked one slice at a time (:func:`_wide_slices`).

    Returns:
        ``(min, max, sums)`` of shapes ``(1,)``, ``(1,)``, ``(2,)``; min is +inf and max -inf where
        no element is finite (the identities of their reductions: no value), the sums then 0.
    """
    inf = torch.full((1,), math.inf, dtype=torch.float64, device=flat.device)
    low, high, sums = inf, -inf, torch.zeros(2, dtype=torch.float64, device=flat.device)
    for x in _wide_slices(flat, work):
        bad = torch.isfinite(x).logical_not_()
        x.masked_fill_(bad, 0.0)
        sums = sums + torch.stack([x.sum(), torch.dot(x, x)])
        low = torch.minimum(low, x.masked_fill_(bad, math.inf).amin())  # the sums are taken: x is free
        high = torch.maximum(high, x.masked_fill_(bad, -math.inf).amax())
    return low, high, sums


def _sums(flat: Tensor, work: Workspace | None) -> tuple[float, float]:
    """``(Σx, Σx²)`` of a 1-D CPU tensor whose elements are all finite, in float64."""
    total = squares = 0.0
    for x in _wide_slices(flat, work):
        total, squares = total + x.sum().item(), squares + torch.dot(x, x).item()
    return total, squares


def _wide_slices(flat: Tensor, work: Workspace | None) -> Iterator[Tensor]:
    """``flat``'s non-empty slices of :data:`~monitored_optim.workspace.PART_ELEMENTS` elements in float64, each a
    new tensor or ``work``'s ``kept`` buffer (valid until the next slice)."""
    for piece in (flat,) if flat.numel() <= PART_ELEMENTS else flat.split(PART_ELEMENTS):
        if piece.numel():
            kept = None if work is None else work.named("kept", piece, torch.float64)
            yield piece.to(torch.float64, copy=True) if kept is None else kept.copy_(piece)


def segment_values(flat: Tensor, lengths: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The values of the pieces of each of the consecutive segments of a flat tensor (a flat chunk's),
    as a :class:`Tally` gives those of a parameter.

    Args:
        flat: 1-D tensor of a dtype of :data:`~monitored_optim.capture.bits.BITS`, the segments laid end to end.
        lengths: int64 tensor of shape ``(k,)`` on ``flat``'s device, positive, summing to ``flat.numel()``.

    Returns:
        Per segment, in the order of :func:`~monitored_optim.histograms.piece_keys`: its counts and
        sums (float64 ``(WIDTH,)``), its min and its max (``(1,)`` each), views of one stacked tensor
        each.
    """
    k = lengths.numel()
    segment = torch.arange(k, device=flat.device).repeat_interleave(lengths, output_size=flat.numel())
    bins = segment * (NBINS + 1) + element_bins(flat)  # NBINS + 1 counters a segment
    counts = occurrences(bins, k * (NBINS + 1)).view(k, NBINS + 1)[:, :NBINS].double()
    bad = torch.isfinite(flat).logical_not_()
    wide = flat.to(torch.float64, copy=True)  # masked in place below: never the caller's float64 tensor
    inf = torch.full((k,), math.inf, dtype=torch.float64, device=flat.device)
    low = inf.scatter_reduce(0, segment, wide.masked_fill(bad, math.inf), "amin")
    high = (-inf).scatter_reduce(0, segment, wide.masked_fill(bad, -math.inf), "amax")
    kept = wide.masked_fill_(bad, 0.0)
    sums = [torch.segment_reduce(v, "sum", lengths=lengths, unsafe=True) for v in (kept, kept.square())]
    return list(zip(torch.cat([counts, torch.stack(sums, 1)], 1).unbind(), low.unsqueeze(1).unbind(),
                    high.unsqueeze(1).unbind()))


def binned(xs: list[Tensor]) -> tuple[list[Tensor], Tensor]:
    """Each element's bin and each tensor's extent, in ops that ``torch.compile`` traces into one pass.

    The compiled routes' binning: their stored changes, grads and parameters are binned where they
    are formed, and the bins counted outside the compiled graph (:func:`counted_bins`).

    Args:
        xs: real floating tensors of dtypes of :data:`~monitored_optim.capture.bits.BITS` (any shapes).

    Returns:
        ``(bins, extents)``: per tensor its elements' bins, uint8 of its number of elements
        (:data:`~monitored_optim.histograms.NBINS` for a non-finite element), and float64 ``(len(xs), 4)``: per tensor
        ``(min, max, Σx, Σx²)`` of its finite elements (min +inf and max -inf where none is).
    """
    bins, extents = [], []
    for x in xs:
        flat = x.reshape(-1)
        bins.append(element_bins(flat))
        finite = torch.isfinite(flat)
        kept = torch.where(finite, flat, 0.0).double()
        extents.append(torch.stack([torch.where(finite, flat, math.inf).amin().double(),
                                    torch.where(finite, flat, -math.inf).amax().double(),
                                    kept.sum(), kept.square().sum()]))
    return bins, torch.stack(extents)


def counted_bins(bins: list[Tensor], extents: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The values of the pieces of each tensor that :func:`binned` binned.

    Args:
        bins: per tensor, its elements' bins (uint8, any length, on one device).
        extents: float64 ``(len(bins), 4)``, per tensor ``(min, max, Σx, Σx²)``.

    Returns:
        Per tensor, as :func:`segment_values`'.
    """
    counts = torch.stack([occurrences(b, NBINS + 1) for b in bins])[:, :NBINS].double()
    return list(zip(torch.cat([counts, extents[:, 2:4]], 1).unbind(), extents[:, 0:1].unbind(),
                    extents[:, 1:2].unbind()))


def element_bins(flat: Tensor) -> Tensor:
    """Each element's bin, from its bits in elementwise integer ops (no lookup, which a compiled loop
    cannot vectorise): its sign and the exponent ``E`` of ``|x|``, of ``|x|`` less one unit in the last
    place for a negative one (so that ``-2**k`` is the lower end of its bin).

    Args:
        flat: 1-D tensor of a dtype of :data:`~monitored_optim.capture.bits.BITS`.

    Returns:
        uint8 tensor like ``flat``: the bins, :data:`~monitored_optim.histograms.NBINS` for a non-finite element.
    """
    kind, mantissa, exponent = BITS[flat.dtype]
    top = (1 << exponent) - 1
    bits = flat.contiguous().view(kind)
    negative = bits < 0
    magnitude = bits & ~torch.iinfo(kind).min
    away = steps((magnitude - negative.to(kind)) >> mantissa, top >> 1)  # -0.0: E' = -1
    side = torch.where(negative, ZERO - away, ZERO + away)
    return torch.where(magnitude >= top << mantissa, NBINS, side).to(torch.uint8)


Bins = tuple[list[Tensor], Tensor]
"""The bins and extents of tensors (:func:`binned`)."""


def bins_of(changes: list[Tensor], after: list[Tensor], grads: list[Tensor], on: bool) -> Bins | None:
    """:func:`binned` of the k stored changes u, the k parameters after the step and their k grads, in
    that order (``3k`` bins, extents ``(3k, 4)``); None unless ``on`` (the histograms are)."""
    return binned([*changes, *after, *grads]) if on else None


def bin_flat(chunk: Flat, before: Tensor, after: Tensor, grads: Tensor, present: list[bool]) -> None:
    """The histograms of a flat chunk's u, p after the step and grads (where present), each member's as
    its pieces (a flat entry is its plan's: none is left from a last step); binned at once in float64,
    where u is exact and p and the grads are as they are."""
    laid = torch.cat([exact_change(after, before), after.double(), grads.double()])
    _hand_out(chunk.members, segment_values(laid, chunk.lengths.repeat(len(KEYS))), present)


def bin_whole(part: list[Entry], bins: Bins, present: list[bool]) -> None:
    """The histograms of a call's whole parameters from their :func:`bins_of`, as their pieces."""
    _hand_out(part, counted_bins(*bins), present)


def _hand_out(members: list[Entry], values: list[tuple[Tensor, Tensor, Tensor]], present: list[bool]) -> None:
    """The members' histogram pieces from the values of their u's, then their p's, then their grads'
    (:func:`~monitored_optim.histograms.piece_keys` order each); a grad's only where the member has a
    grad (else none is left from a last step)."""
    k = len(members)
    for j, kind in enumerate(("u", "param", "grad")):
        keys = piece_keys(KEYS[kind])
        for e, has, got in zip(members, present, values[j * k:(j + 1) * k]):
            if has or kind != "grad":
                e.pieces.update(zip(keys, got))
            else:
                for key in keys:
                    e.pieces.pop(key, None)

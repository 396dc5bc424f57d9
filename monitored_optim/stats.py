"""Per-tensor moments: raw sums on the device, finished as ``(mean, m2)`` and copied to the host once.

Each tensor x is reduced on its device to raw sums when it is added to a :class:`Batch` (centred
for tensors whose mean dwarfs their spread, such as a LayerNorm weight near 1.0 with std 1e-4, and
for temporaries, in place; uncentred otherwise: :func:`_centred`), :meth:`Batch.finish` turns every
row of a logging step into ``(mean, m2)`` in float64 at once, with ``m2 = sum((x - mean)^2)``, and
:meth:`Moments.host` copies them with one copy per device. The element count n stays on the host.
From a row the figures (:class:`~monitored_optim.hosted.MomentTable`) take
``std = sqrt(m2 / (n - 1))`` (Bessel's correction, as ``torch.std(correction=1)``) and
``||x||_2 = sqrt(m2 + n * mean^2)`` (both terms >= 0: no cancellation). Rows of disjoint parts
combine as power sums (Chan, Golub & LeVeque 1979), which is what sharded training needs
(``monitored_optim/distributed/``).
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor

from .workspace import PART_ELEMENTS, Workspace

LOW_PRECISION = (torch.float16, torch.bfloat16)
"""fp16 and bf16: reduced in float32 here; the capture's low-precision kind (:mod:`~monitored_optim.capture.rules`)."""

MISS = 5e-5
"""The share of an update's norm that a rebuilt or inverted update may miss and still be taken: half
the 1e-4 tolerance on norms (:data:`~monitored_optim.capture.rules.ALIGNED_ABOVE`, the schedule-free views'
rebuild)."""


def moments(x: Tensor, scratch: bool = False) -> Tensor:
    """The ``(mean, m2)`` of ``x`` as a float64 tensor of shape ``(2,)`` on ``x``'s device.

    A one-tensor :class:`Batch` with the centred pass.

    Args:
        x: any floating or complex tensor, any shape. Complex counts as pairs of reals, sparse is
            densified, bf16/fp16 is promoted to float32 first. Its element count is
            :func:`count` ``(x)``, which the caller keeps on the host.
        scratch: ``x`` is a temporary the caller drops: centre it in place instead of allocating.

    Returns:
        Tensor of shape ``(2,)``, dtype float64. No host synchronisation.
    """
    batch = Batch()
    batch.add([x], [True], scratch=scratch)
    row = batch.finish()[0]
    assert row is not None  # the one slot has its one row
    return row


def _centred(x: Tensor, scratch: bool = False, work: Workspace | None = None) -> Tensor:
    """Centred raw sums of one tensor: ``(mean, sum(x - mean), ||x - mean||)``, two passes; the
    centred values are formed in place when ``scratch`` (``x`` is the caller's temporary), else a
    slice of :data:`~monitored_optim.workspace.PART_ELEMENTS` elements at a time for a large tensor
    (no full-size temporary).

    Centring keeps the spread of a tensor whose mean dwarfs it (a LayerNorm weight near 1.0 with
    std 1e-4), and the sum of the centred values removes the rounding of the float32 mean (the
    shifted-data formulas, Chan, Golub & LeVeque 1983). Uncentred sums ``(sum(x), ||x||)`` lose
    about 1e-7 * mean^2 / var of the variance in float32: :class:`Batch` takes them where
    ``mean^2 / var <= CENTRE_ABOVE``. ``work``: where the centred copy of a tensor of at most
    :data:`~monitored_optim.workspace.PART_ELEMENTS` elements goes
    (:meth:`~monitored_optim.workspace.Workspace.one`), else a new tensor.

    Returns:
        Tensor of shape ``(3,)`` in ``x``'s real dtype (float32 for bf16/fp16), on its device.
    """
    low = x.dtype in LOW_PRECISION
    dense = x.detach() if low and not x.is_sparse else _dense_real(x)
    if dense.numel() == 0:
        return _dense_real(dense).new_zeros(3)
    in_place = scratch and not low and not x.is_sparse and dense.data_ptr() == x.data_ptr()
    if in_place or dense.numel() <= PART_ELEMENTS or not dense.is_contiguous():
        dense = _dense_real(dense)
        mean = dense.mean()
        centred = dense.sub_(mean) if in_place else (dense - mean if work is None else
                                                     torch.sub(dense, mean, out=work.one(dense)))
        return torch.stack([mean, centred.sum(), _norm(centred)])
    mean = dense.mean(dtype=torch.float32 if low else dense.dtype)
    total = mean.new_zeros((), dtype=torch.float64)
    squares = mean.new_zeros((), dtype=torch.float64)
    for piece in dense.view(-1).split(PART_ELEMENTS):
        centred = piece.to(mean.dtype) - mean
        total.add_(centred.sum().double())
        squares.add_(_norm(centred).double().square())
    return torch.stack([mean.double(), total, squares.sqrt()]).to(mean.dtype)


ROW = 4096
"""Elements per row of :func:`_norm`'s row-wise reduction."""

def _norm(x: Tensor) -> Tensor:
    """``||x||_2`` in ``x``'s dtype, accurate for large float32 tensors.

    torch's float32 vector norm on a CPU accumulates in float32, an error that grows with the
    element count. A contiguous tensor of more
    than 16 rows is reduced per row of :data:`ROW` elements (each row's error stays ~1e-7) and the
    row norms are combined in float64; this is also faster, the rows being reduced in parallel.
    """
    if x.numel() <= 16 * ROW:
        return torch.linalg.vector_norm(x)
    if not x.is_contiguous():  # per row of the first dimension (no copy), rows combined in float64
        rows = torch.linalg.vector_norm(x, dim=tuple(range(1, x.dim()))) if x.dim() > 1 else x.abs()
        return torch.linalg.vector_norm(rows.reshape(-1).double()).to(x.dtype)
    flat = x.view(-1)
    k = flat.numel() // ROW
    parts = [torch.linalg.vector_norm(flat[:k * ROW].view(k, ROW), dim=1)]
    if flat.numel() > k * ROW:
        parts.append(torch.linalg.vector_norm(flat[k * ROW:]).reshape(1))
    return torch.linalg.vector_norm(torch.cat(parts).double()).to(x.dtype)


Scale = Union[float, Tensor, Sequence[Union[float, Tensor]], None]
"""What :meth:`Batch.add` multiplies its tensors by: nothing (``None``), one factor for all (a
float or a one-element Tensor), or one per tensor (a sequence of floats and one-element Tensors,
or a 1-D Tensor)."""


class Batch:
    """Raw sums of many tensors, taken when they are added, finished together into ``(mean, m2)``.

    A logging step adds p_before and the grads before the base step and each chunk of rebuilt
    updates after it, so that no tensor has to outlive its reduction; :meth:`finish` then turns
    every row into float64 ``(mean, m2)`` with a few ops per device. Uncentred rows of one add come
    from one ``torch._foreach_norm`` and one stack of sums per device and dtype; centred rows (see
    :func:`_centred`) one tensor at a time.

    Example::

        batch = Batch()
        slots = batch.add([p.grad for p in params], [False] * len(params), scale=1 / grad_scale)
        rows = batch.finish()      # rows[slots[i]]: (mean, m2) of params[i].grad / grad_scale
    """

    def __init__(self, work: Workspace | None = None) -> None:
        self.work = work  # where the centred pass's temporaries go (the monitor's logging steps), or None
        # per row added, its element count and the slot it belongs to, as machine integers: a logging
        # step's thousands of rows become two tensors at once in finish()
        self._counts = array("q")
        self._owner = array("q")
        self._slots = 0
        self._parts: dict[tuple[torch.device, int], list[tuple[Sequence[int], Tensor | None]]] = {}
        self._store: dict[tuple[torch.device, int], Tensor] = {}
        self._used: dict[tuple[torch.device, int], int] = {}

    def add(self, xs: Sequence[Tensor], centre: Sequence[bool], scale: Scale = None,
            scratch: bool | Sequence[bool] = False, into: Sequence[int | None] | None = None) -> list[int]:
        """Reduce ``scale * x`` for each x of ``xs`` to raw sums now; return their slots in :meth:`finish`.

        Args:
            xs: floating or complex tensors of any shapes and devices (see :func:`moments`).
            centre: per tensor, whether to take the centred pass
                (:attr:`~monitored_optim.hosted.MomentTable.needs_centring`).
            scale: see :data:`Scale`; sums are linear, so the factor is applied when finishing.
            scratch: per tensor (or for all), whether it is a temporary that the sums may
                overwrite: it takes the centred pass in place whatever ``centre`` says, exact for
                any spread.
            into: per tensor, a slot returned earlier that this tensor is another disjoint part of
                (its moments are merged into that slot's), or None for a new slot.

        Returns:
            One slot index per tensor, in order.
        """
        first = self._enter([count(x) for x in xs], into)
        factors = _factor_vector(scale, xs)
        scratch = [scratch] * len(xs) if isinstance(scratch, bool) else list(scratch)
        groups: dict[tuple[torch.device, torch.dtype | None], list[int]] = {}
        for i, x in enumerate(xs):  # a temporary is centred in place (exact for any spread)
            groups.setdefault((x.device, None if centre[i] or scratch[i] else _real_dtype(x)), []).append(i)
        for (device, plain), idx in groups.items():
            if plain is None:
                table = torch.stack([_centred(xs[i], scratch[i], self.work).double() for i in idx])
            else:
                dense = [_dense_real(xs[i]) for i in idx]
                table = torch.stack([torch.stack([d.sum() for d in dense]), _norms(dense)], 1)
            f = None if factors is None else _pick(factors, idx, len(xs)).to(device)
            self._place(table, [first + i for i in idx], f)
        return self._owner[first:].tolist()

    def put(self, rows: Tensor, counts: Sequence[int], into: Sequence[int]) -> None:
        """Add rows of shifted sums computed elsewhere (the fused capture, ``fused.shifted_rows``).

        Args:
            rows: float64 tensor of shape ``(k, 3)``: per tensor ``(c, Σ(x - c), sqrt(Σ(x - c)^2))``
                for a shift c (read as :func:`_centred`'s rows).
            counts: the k element counts (:func:`count`).
            into: the k slots (from :meth:`slot`) the rows are parts of.
        """
        first = self._enter(list(counts), into)
        self._place(rows, range(first, first + len(counts)), None)

    def _enter(self, counts: list[int], into: Sequence[int | None] | None) -> int:
        """Record the counts of new rows and their slots (a new one per None); the first row's index."""
        first = len(self._counts)
        self._counts.extend(counts)
        made = [] if into is None else [target for target in into if target is not None]
        if into is not None and len(made) == len(into):  # parts of slots already made (the fused capture's)
            self._owner.extend(made)
            return first
        for target in (into if into is not None else [None] * len(counts)):
            self._owner.append(self._slots if target is None else target)
            self._slots += target is None
        return first

    def _place(self, table: Tensor, rows: Sequence[int], factors: Tensor | None) -> None:
        """Copy a small table of sums (one row per entry of ``rows``) into the store of its device and width."""
        key = (table.device, table.shape[1])
        start = self._reserve(key, len(rows))
        self._store[key][start:start + len(rows)].copy_(table)  # the small table dies here
        self._parts.setdefault(key, []).append((rows, factors))

    def finish(self) -> Moments:
        """``(mean, m2)`` of every slot added so far, as one float64 table per device
        (:class:`Moments`; a :meth:`slot` that got no rows has none).

        Centred ``(c, r, q)``: mean = c + r/n, m2 = q^2 - r^2/n. Uncentred ``(s, q)``: mean = s/n,
        m2 = q^2 - s^2/n. Scaled by f: mean * f, m2 * f^2. Empty tensors give ``(0, 0)``. Parts of
        one slot (``into``) combine as mean = Σ n_i·mean_i / N, m2 = Σ m2_i + n_i·(mean_i - mean)^2
        (Chan, Golub & LeVeque 1979; all terms >= 0), with a few ops per device for all slots (a
        slot of one part keeps its row exactly).
        """
        per_device: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}  # (mean, m2) rows, their indices
        counts = _int64(self._counts).double()
        for key, (rows, idx) in self._rows(counts).items():
            per_device.setdefault(key[0], []).append((rows, idx))
        tables: dict[torch.device, Tensor] = {}
        order: dict[torch.device, Tensor] = {}
        owners = _int64(self._owner)
        for device, chunks in per_device.items():
            rows = torch.cat([r for r, _ in chunks])
            idx = torch.cat([ids for _, ids in chunks])
            slots, owner = torch.unique(owners[idx], return_inverse=True)
            owner, n = owner.to(device), counts[idx].to(device)
            zeros = rows.new_zeros(len(slots))
            parts = zeros.index_add(0, owner, torch.ones_like(n))
            total = zeros.index_add(0, owner, n).clamp(min=1)
            mean = torch.where(parts == 1, zeros.index_add(0, owner, rows[:, 0]),
                               zeros.index_add(0, owner, n * rows[:, 0]) / total)
            m2 = zeros.index_add(0, owner, rows[:, 1] + n * (rows[:, 0] - mean[owner]).square())
            tables[device] = torch.stack([mean, m2], 1)
            order[device] = slots
        sizes = torch.zeros(self._slots, dtype=torch.float64).index_add_(0, owners, counts)
        return Moments(tables, order, self._slots, sizes)

    def _reserve(self, key: tuple[torch.device, int], k: int) -> int:
        """Room for ``k`` more rows of sums in the store of ``key`` (device, width); their first index.

        The sums of all adds live in one float64 buffer per device and width, allocated before the
        first large temporary of a logging step and doubled when full, rather than as one small
        tensor per add: small allocations that outlive the temporaries between them fragment the
        host allocator's heap."""
        used = self._used.get(key, 0)
        store = self._store.get(key)
        if store is None or used + k > len(store):
            grown = torch.empty((max(4096, 2 * (used + k)), key[1]), dtype=torch.float64, device=key[0])
            if store is not None:
                grown[:used].copy_(store[:used])
            self._store[key] = grown
        self._used[key] = used + k
        return used

    def slot(self) -> int:
        """A new slot with no rows yet, for :meth:`add`'s ``into`` (:meth:`finish` gives None for it
        if nothing is added)."""
        self._slots += 1
        return self._slots - 1

    def slots(self, k: int) -> range:
        """``k`` new consecutive slots, as :meth:`slot`."""
        self._slots += k
        return range(self._slots - k, self._slots)

    def _rows(self, counts: Tensor) -> dict[tuple[torch.device, int], tuple[Tensor, Tensor]]:
        """Per store (device, width): ``(mean, m2)`` of every tensor added there, shape ``(R, 2)``
        float64, and the indices of those tensors (in :meth:`add` order, int64 ``(R,)`` on the
        host); ``counts``: the element count of every tensor added, float64 on the host."""
        out = {}
        for (device, width), parts in self._parts.items():
            slots = torch.cat([torch.arange(part.start, part.stop) if isinstance(part, range)
                               else torch.tensor(part, dtype=torch.long) for part, _ in parts])
            table = self._store[(device, width)][:self._used[(device, width)]]
            n = counts[slots].clamp(min=1).to(device)
            shift, total, norm = table.unbind(1) if width == 3 else (torch.zeros_like(n), *table.unbind(1))
            rows = torch.stack([shift + total / n, norm * norm - total * total / n], 1)
            if any(f is not None for _, f in parts):
                f = torch.cat([torch.ones(len(p), dtype=torch.float64, device=device) if f is None else f
                               for p, f in parts])
                rows = rows * torch.stack([f, f * f], 1)
            out[(device, width)] = (rows, slots)
        return out


@dataclass(frozen=True)
class Moments:
    """``(mean, m2)`` of the slots of a finished :class:`Batch`: ``tables[device]``, float64 of shape
    ``(S_d, 2)``, whose row j is slot ``order[device][j]`` (int64 CPU tensors of shape ``(S_d,)``), of
    ``slots`` slots in all (a slot in no table has no rows); ``sizes``, float64 CPU ``(slots,)``: the
    elements of each slot's rows (:func:`count`; a parameter's p_before slot: its element count)."""

    tables: dict[torch.device, Tensor]
    order: dict[torch.device, Tensor]
    slots: int
    sizes: Tensor

    def __getitem__(self, slot: int) -> Tensor | None:
        """The row of ``slot``, a float64 tensor of shape ``(2,)`` on its device, or None."""
        at = self._where.get(slot)
        return None if at is None else self.tables[at[0]][at[1]]

    @functools.cached_property
    def _where(self) -> dict[int, tuple[torch.device, int]]:
        """Slot -> ``(device, row)``, built at the first :meth:`__getitem__` (the sharded path's)."""
        return {slot: (device, j) for device, slots in self.order.items() for j, slot in enumerate(slots.tolist())}

    def host(self, index: Tensor, extra: list[Tensor]) -> tuple[Tensor, Tensor, list[list[float]]]:
        """The moments of the slots ``index`` names and the values of ``extra``, on the host.

        One device-to-host copy per device; ``extra`` are 1-D float64 device tensors.

        Args:
            index: int64 CPU tensor of slots, of any shape S.

        Returns:
            ``(pairs, present, values)``: float64 of shape ``S + (2,)`` (zeros for a slot with no
            rows), bool of shape S (the slot has rows), and ``extra[i].tolist()`` for each i.
        """
        pairs = torch.zeros((self.slots, 2), dtype=torch.float64)
        present = torch.zeros(self.slots, dtype=torch.bool)
        values: list[list[float]] = [[] for _ in extra]
        for device in set(self.tables) | {x.device for x in extra}:
            mine = [i for i, x in enumerate(extra) if x.device == device]
            table = self.tables.get(device, torch.zeros((0, 2), dtype=torch.float64, device=device))
            flat = torch.cat([table.reshape(-1), *(x if (x := extra[i]).dim() == 1 else x.reshape(-1)
                                                   for i in mine)]).cpu()  # no view of a 1-D one
            order = self.order.get(device, torch.zeros(0, dtype=torch.long))
            pairs[order] = flat[:table.numel()].view(-1, 2)
            present[order] = True
            rest, k = flat[table.numel():].tolist(), 0
            for i in mine:
                values[i], k = rest[k:k + extra[i].numel()], k + extra[i].numel()
        return pairs[index], present[index], values


def _int64(values: array) -> Tensor:
    """A copy of an ``array("q")`` as an int64 CPU tensor of shape ``(len(values),)``."""
    return torch.frombuffer(values, dtype=torch.int64).clone() if values else torch.zeros(0, dtype=torch.int64)


def _norms(dense: list[Tensor]) -> Tensor:
    """:func:`_norm` of each tensor (one dtype and device), the small ones by one ``_foreach_norm``."""
    large = {j for j, d in enumerate(dense) if d.numel() > 16 * ROW}
    rest = [d for j, d in enumerate(dense) if j not in large]
    small = iter(torch._foreach_norm(rest) if rest else [])
    return torch.stack([_norm(d) if j in large else next(small) for j, d in enumerate(dense)])


def _factor_vector(scale: Scale, xs: Sequence[Tensor]) -> Tensor | None:
    """``scale`` as a float64 vector (one entry per tensor of ``xs``, or one for all), or None for ones."""
    if scale is None:
        return None
    if isinstance(scale, Tensor):
        return scale.detach().reshape(-1).double()
    if isinstance(scale, (int, float)):
        return torch.tensor([float(scale)], dtype=torch.float64)
    if not any(isinstance(f, Tensor) for f in scale):
        return torch.tensor([float(f) for f in scale], dtype=torch.float64)
    return torch.stack([torch.as_tensor(f, dtype=torch.float64, device=x.device).reshape(())
                        for f, x in zip(scale, xs)])


def _pick(factors: Tensor, idx: list[int], k: int) -> Tensor:
    """The factors of the tensors ``idx`` (of k) from a vector of k (or of one, for all)."""
    if factors.numel() == 1:
        return factors.expand(len(idx))
    return factors if idx == list(range(k)) else factors[idx]


def _real_dtype(x: Tensor) -> torch.dtype:
    """The dtype :func:`_dense_real` gives ``x``."""
    if x.is_complex():
        return x.dtype.to_real()
    return torch.float32 if x.dtype in LOW_PRECISION else x.dtype


CENTRE_ABOVE = 100.0
"""mean^2 / var above which a tensor's moments need the centred pass (see :func:`_centred`)."""

RELIABLE_BELOW = 1e4
"""mean^2 / var below which uncentred float32 sums still give the variance to about 1e-3 (their
rounding costs about 1e-7 * mean^2 / var of it); above it the std is not reported."""


def count(x: Tensor) -> int:
    """Number of real elements that :func:`moments` sees in ``x`` (complex counts twice)."""
    return x.numel() * (2 if x.is_complex() else 1)


def _dense_real(x: Tensor) -> Tensor:
    """``x`` as the real dense tensor that the sums read (any shape: they reduce over all of it)."""
    if x.requires_grad and torch.is_grad_enabled():
        x = x.detach()
    if x.is_sparse:
        x = x.coalesce().to_dense()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype in LOW_PRECISION:
        x = x.float()
    return x


KINDS = ("p", "grad", "u")
"""The kinds of a logging step's :class:`~monitored_optim.hosted.MomentTable`, in its columns: p_before,
its grad, its update."""

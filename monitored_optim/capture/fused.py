"""Fused capture: a chunk's stored changes and their sums in one compiled function.

On a logging step the eager capture runs a dozen small ops per parameter (rebuild, inversion,
centring, sums), so its cost follows the number of tensors. The fused path hands a chunk of up to
:data:`CHUNK` parameters of one param group, device, dtype and kind to one function that

* rebuilds each update from the optimizer's state (the view's ``fused`` form, e.g. Adam's
  d = c·m / (sqrt(v) + eps·b)), inverts the rounding of the store,
  p_before = fl(fl(p_after - d) / s), u = p_after - p_before (:func:`~monitored_optim.capture.change.stored_change`'s
  rule), or takes p_before from the snapshot of the snapshot rule (vectors, near-constant matrices);
* reduces p_before (before the step, :func:`prior`), the grad and u to one-pass *shifted* sums
  accumulated in float64: with c the
  tensor's first element, ``(c, Σ(x - c), sqrt(Σ(x - c)^2))``, from which
  ``stats.Batch`` takes mean = c + Σ(x - c)/n and m2 = Σ(x - c)^2 - (Σ(x - c))^2/n. Shifting by a
  value of the tensor keeps the spread of a LayerNorm weight near 1.0 with std 1e-4 (the
  shifted-data algorithm, Chan, Golub & LeVeque 1983); float64 accumulation keeps the sums of
  large tensors exact to about 1e-16 per element.

:func:`torch.compile` (inductor) fuses each function into a few kernels that read p, grad and
state once and write nothing of parameter size but, with the histograms on, each element's bin of u,
p and the grad (a byte each, a bounded share per call, :data:`BINS_SHARE`); shapes are dynamic, so
chunks with the same count, kinds and ranks (identical transformer blocks) share one compiled
graph. Where compiling fails the same function runs eagerly (a warning, once), which gives the same
figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors

from .. import histograms, stats
from ..updates import CLONE, Cloned, View, rebuild
from . import binning
from .compiler import Fuser, enabled
from .binning import Bins, bins_of
from .plan import Entry, Flat
from .route import SMALL
from .rules import at_powers_of_two
from .change import exact_change, stored_change

CHUNK = 32
"""Most parameters handed to one call: larger chunks mean fewer calls but longer compiles (inductor's
compile time grows with the graph)."""

BINS_SHARE = 64
"""Where the histograms are on, the bins of one call take at most 1/BINS_SHARE of the bytes of the
parameters taken whole (1.6%: a logging step's extra memory stays within 2% of them), or
:data:`BINS_BYTES` where that is more (a larger parameter is alone in its call)."""

BINS_BYTES = 1 << 22
"""The bytes of bins that one call may always take (4 MiB, a few temporaries' worth): a small model's
whole parameters are then binned in as few calls as they would be without the histograms."""

FLAT_ELEMENTS = 1 << 14
"""Most elements of one flat chunk (its float64 temporaries stay a few MiB)."""


def flat_chunks(sizes: Sequence[int], most: float = FLAT_ELEMENTS, count: float = math.inf) -> list[range]:
    """The flat chunks of parameters of ``sizes`` elements, in order: greedy consecutive runs of at
    most ``most`` elements in all (a single parameter of more would make a chunk of its own) and at
    most ``count`` parameters.

    Args:
        sizes: element counts (ints), one per parameter.
        most: elements per chunk, :data:`FLAT_ELEMENTS` by default.
        count: parameters per chunk, any number by default.

    Returns:
        Ranges of indices into ``sizes`` covering ``range(len(sizes))`` in order (empty for none).
    """
    chunks, start, size = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and (size + n > most or i - start == count):
            chunks.append(range(start, i))
            start, size = i, 0
        size += n
    if len(sizes) > start:
        chunks.append(range(start, len(sizes)))
    return chunks


def flat_copy(tensors: list[Tensor]) -> Tensor:
    """``tensors`` laid end to end in a new buffer: a flat chunk's p_before.

    Args:
        tensors: a non-empty list of dense tensors of one dtype and device (any shapes).

    Returns:
        A new 1-D tensor of their dtype with ``sum(t.numel())`` elements, never a view of one of
        them (``_flatten_dense_tensors`` returns a view of a single tensor, which the step would
        change under the snapshot).
    """
    return _flatten_dense_tensors(tensors) if len(tensors) > 1 else tensors[0].reshape(-1).clone()


def segment_rows(x: Tensor, lengths: Tensor) -> Tensor:
    """:func:`shifted_rows` of the consecutive segments of a flat tensor.

    Args:
        x: 1-D real floating tensor, the segments laid end to end.
        lengths: int64 tensor of shape ``(k,)`` on ``x``'s device, positive, summing to ``x.numel()``.

    Returns:
        Float64 tensor of shape ``(k, 3)``: per segment ``(c, Σ(x - c), sqrt(Σ(x - c)^2))``, c its
        first element.
    """
    x = x.double()
    shift = x[lengths.cumsum(0) - lengths]
    y = x - shift.repeat_interleave(lengths, output_size=x.numel())
    return torch.stack([shift, torch.segment_reduce(y, "sum", lengths=lengths),
                        torch.segment_reduce(y * y, "sum", lengths=lengths).sqrt()], 1)


def flat(before: Tensor, after: Tensor, grads: Tensor, lengths: Tensor) -> Tensor:
    """Rows of p_before, grad and u = p_after - p_before of a flat chunk.

    Args:
        before, after, grads: 1-D float32/float64 tensors of one length, the chunk's parameters
            before the step, after it and their grads laid end to end (``lengths`` apart).
        lengths: see :func:`segment_rows`.

    Returns:
        Float64 tensor of shape ``(3, k, 3)``; u is formed in float64 (exact also where it crosses 0).
    """
    return torch.stack([segment_rows(before, lengths), segment_rows(grads, lengths),
                        segment_rows(exact_change(after, before), lengths)])


def shifted_rows(xs: Sequence[Tensor]) -> Tensor:
    """``(c, Σ(x - c), sqrt(Σ(x - c)^2))`` per tensor, c its first element, accumulated in float64.

    Args:
        xs: non-empty real floating tensors (any shapes, one device).

    Returns:
        Float64 tensor of shape ``(len(xs), 3)`` on their device (the centred rows of
        :class:`~monitored_optim.stats.Batch`).
    """
    rows = []
    for x in xs:
        flat = x.reshape(-1).double()
        shift = flat[0]
        y = flat - shift
        rows.append(torch.stack([shift, y.sum(), y.square().sum().sqrt()]))
    return torch.stack(rows)


def prior(xs: list[Tensor]) -> Tensor:
    """Before the step, in one pass: per tensor ``[min, max, c, Σ(x - c), sqrt(Σ(x - c)^2), exact]`` in
    float64, shape ``(k, 6)``: the bounds (where they are equal, a matrix initialised at 0, p_before
    is that value exactly, :func:`~monitored_optim.capture.change.bounds`), the :func:`shifted_rows` of p_before, taken
    here because p_after - u cannot give p_before where the step made p non-finite, and
    :func:`~monitored_optim.capture.rules.at_powers_of_two` of p_before. Each tensor's reductions are
    traced together, over its flat view, so that inductor fuses them into one loop per tensor (it
    fuses only nodes close in the graph and of one loop shape)."""
    rows = []
    for x in xs:
        flat = x.reshape(-1)
        rows.append(torch.cat([torch.stack([flat.min(), flat.max()]).double(), shifted_rows([flat])[0],
                               at_powers_of_two(flat, flat)]))
    return torch.stack(rows)


def inverted(rebuild: Callable[..., list[Tensor]], args: tuple[Any, ...], factors: Tensor, s: Tensor | None,
             extremes: Tensor, after: list[Tensor], grads: list[Tensor], binned: bool = False
             ) -> tuple[Tensor, Bins | None]:
    """Rows of the grad and u of parameters whose update is rebuilt from state.

    Args:
        rebuild: a view's fused form: ``rebuild(*args)`` gives one tensor r per parameter with
            d = factor·r the update the step added (``Scaled(r, factor)``).
        factors: float64 tensor of shape ``(k,)``.
        s: the decoupled-decay factor 1 - lr·λ (a 0-dim tensor: p ← s·p before the add), or None.
        extremes: the bounds of the parameters before the step (:func:`prior`), float64 ``(k, 2)``.
        after: the k parameters after the step (float32/float64, each with its grad in ``grads``).
        binned: whether u, p and the grads are binned (:func:`~monitored_optim.capture.binning.bins_of`).

    Returns:
        ``(rows, bins)``: float64 ``(2, k, 3)``, :func:`shifted_rows` of the grad and of u (those of
        p_before come from :func:`prior`), and :func:`~monitored_optim.capture.binning.bins_of` them
        (None unless ``binned``).
    """
    changes = []
    for p, r, f, (lo, hi) in zip(after, rebuild(*args), factors.unbind(), extremes.unbind()):
        b = minus_scaled(p, r, f)
        b = b if s is None else b / s.to(p.dtype)
        b = torch.where(lo == hi, lo.to(p.dtype), b)  # a constant is recovered exactly
        changes.append(p - b)  # exact (Sterbenz)
    return grad_and_change_rows(grads, changes), bins_of(changes, after, grads, binned)


def minus_scaled(p: Tensor, r: Tensor, f: Tensor) -> Tensor:
    """p - f·r rounded once in p's dtype, as ``torch.sub(p, r, alpha=f)`` stores it (a fused multiply-add,
    the factor in p's dtype): the eager inversion's arithmetic, and the optimizers' own ``add_(t, alpha=)``.

    Args:
        p, r: tensors of one shape, float32 or float64 (p's dtype; r may be wider).
        f: a float64 0-dim tensor.

    Returns:
        A tensor like ``p``. For float32 the product of r and f in float32 is exact in float64, so the
        one rounding is the float64 difference's (rounded twice: equal but for ties in float64); a
        float64 ``p`` gets the product rounded first.
    """
    if p.dtype is torch.float32:
        return (p.double() - r.float().double() * f.float().double()).float()
    return p - (r * f).to(p.dtype)


def grad_and_change_rows(grads: list[Tensor], changes: list[Tensor]) -> Tensor:
    """:func:`shifted_rows` of k grads and of k stored changes u, float64 of shape ``(2, k, 3)``."""
    return torch.stack([shifted_rows(grads), shifted_rows(changes)])


def snapshotted(before: list[Tensor], after: list[Tensor], grads: list[Tensor],
                binned: bool = False) -> tuple[Tensor, Tensor, Bins | None]:
    """Rows of p_before, grad and u of parameters with an exact snapshot, their power-of-two sums,
    and where ``binned`` their :func:`~monitored_optim.capture.binning.bins_of`, u formed in float64
    (exact also where it crosses 0).

    Returns float64 ``(3, k, 3)``, :func:`~monitored_optim.capture.rules.at_powers_of_two` of each ``(k,)``,
    and the bins or None."""
    changes = [p - b for p, b in zip(after, before)]
    rows = [shifted_rows(before), shifted_rows(grads), shifted_rows(changes)]
    exact = [exact_change(p, b) for p, b in zip(after, before)] if binned else []
    return (torch.stack(rows), torch.cat([at_powers_of_two(b, p) for p, b in zip(after, before)]),
            bins_of(exact, after, grads, binned))


def copied(xs: list[Tensor]) -> list[Tensor]:
    """Exact copies of ``xs`` (the snapshot rule's p_before of a chunk), one kernel for all when compiled."""
    return [x.clone() for x in xs]


def chunk_flat(small: list[Entry]) -> list[Flat]:
    """The flat entries in chunks (:func:`flat_chunks`), each entry's ``flat`` set to its chunk.

    A chunk holds entries of one param group, device and dtype, at most :data:`FLAT_ELEMENTS` elements."""
    kinds: dict[tuple[Any, ...], list[Entry]] = {}
    for e in small:
        kinds.setdefault((id(e.group), e.p.device, e.p.dtype), []).append(e)
    chunks = []
    for members in kinds.values():
        sizes = [e.p.numel() for e in members]
        for span in flat_chunks(sizes):
            chunk, lengths = members[span.start:span.stop], sizes[span.start:span.stop]
            params = [x.p for x in chunk]
            chunks.append(Flat(chunk, params, lengths, torch.tensor(lengths, device=params[0].device)))
            for x in chunk:
                x.flat = chunks[-1]
    return chunks


def dense_grad(p: Tensor) -> bool:
    """Whether ``p`` has a dense grad (a sparse one, ``nn.Embedding(sparse=True)``'s, has no fused form)."""
    return p.grad is not None and p.grad.layout is torch.strided


class Fused:
    """The fused routes of one monitor: flat chunks and whole parameters through compiled passes.

    Args:
        view: the monitor's update view.
        mode: ``MonitorConfig.compile`` (see :func:`~monitored_optim.capture.compiler.enabled`).
        binned: the histograms family is on: the p, grads and u of the flat chunks are binned
            (:func:`~monitored_optim.capture.binning.segment_values`), and those of whole parameters in
            their compiled pass (:func:`~monitored_optim.capture.binning.bins_of`), a call's bins
            within the logging step's budget.
    """

    def __init__(self, view: View, mode: str, binned: bool = False) -> None:
        self.view = view
        self.mode = mode
        self.binned = binned
        self.fuser = Fuser(mode)

    def way(self, group: dict[str, Any]) -> str | None:
        """What the fused routes may do for ``group``: None (nothing: an optimizer without a view, or
        a step that rewrites ``p.grad``, whose sums must be taken before it), ``"copy"`` (flat small parameters and the
        snapshot
        rule's copies) or ``"rebuild"`` (also the view's fused form)."""
        if self.view is CLONE or not self.view.keeps_grad(group):
            return None
        return "rebuild" if self.view.fusable(group) else "copy"

    def form(self, p: Tensor) -> str | None:
        """The form the fused routes may take ``p`` in where its group's :meth:`way` allows it, from
        its metadata alone: ``"flat"`` (a non-empty dense float32/float64 parameter of at most
        :data:`~monitored_optim.capture.route.SMALL` elements), ``"whole"`` (a larger one, where
        compiling is enabled for its device), or None (eager)."""
        if type(p) not in (Tensor, torch.nn.Parameter) or p.dtype not in (torch.float32, torch.float64) \
                or p.layout is not torch.strided or p.numel() == 0:
            return None
        if p.numel() <= SMALL:
            return "flat"
        return "whole" if enabled(self.mode, p.device) else None

    def chunks(self, flat: list[Entry]) -> list[Flat]:
        """The entries captured flat, laid into chunks (:func:`chunk_flat`)."""
        return chunk_flat(flat)

    def before(self, chunks: list[Flat], copies: list[Entry], whole: list[Entry], batch: stats.Batch) -> list[Tensor]:
        """Take p_before of the fused routes; returns the flat chunks' (one buffer per chunk).

        ``copies`` get the snapshot rule's compiled copies; of ``whole`` (every entry of a fused
        route but the flat ones), those without a snapshot then (the view rebuilds them) get their
        bounds and p_before's sums."""
        befores = [flat_copy(chunk.params) for chunk in chunks]
        for chunk in device_chunks(copies):
            for e, before in zip(chunk, self.fuser(copied, [e.p for e in chunk], device=chunk[0].p.device)):
                e.snapshot = Cloned(before)
        for chunk in device_chunks([e for e in whole if e.snapshot is None]):
            rows = self.fuser(prior, [e.p for e in chunk], device=chunk[0].p.device)
            batch.put(rows[:, 2:5], [stats.count(e.p) for e in chunk], [e.slots["p"] for e in chunk])
            for e, extremes, exact in zip(chunk, rows[:, :2].unbind(), rows[:, 5:].unbind()):
                e.extremes = extremes
                e.pieces["exact"] = exact
        return befores

    def after(self, entries: list[Entry], chunks: list[Flat], befores: list[Tensor],
              state: dict[Tensor, dict[str, Any]], batch: stats.Batch) -> None:
        """After the step: the rows of every flat chunk (p_before, grad and u), and of ``entries`` (the
        whole ones) those of the snapshotted and the grad and u of the rebuilt ones, into ``batch``;
        one call per chunk of up to :data:`CHUNK` parameters of one param group, device, dtype, rank
        and route, so that identical blocks share a compiled graph (and, where binned, whose bins
        take at most 1/:data:`BINS_SHARE` of these parameters' bytes or :data:`BINS_BYTES`: one byte
        per element and series)."""
        kinds: dict[tuple[Any, ...], list[Entry]] = {}
        for e in entries:
            key = (id(e.group), e.p.device, e.p.dtype, e.p.dim(), isinstance(e.snapshot, Cloned))
            kinds.setdefault(key, []).append(e)
        for chunk, before in zip(chunks, befores):
            grads, present = _grads(chunk.params)
            after, grad = _flatten_dense_tensors(chunk.params), _flatten_dense_tensors(grads)
            rows = flat(before, after, grad, chunk.lengths)  # eager: faster than compiled here
            _put(batch, chunk.members, rows, stats.KINDS, present, chunk.sizes)
            if self.binned:
                binning.bin_flat(chunk, before, after, grad, present)
        total = sum(e.p.numel() * e.p.element_size() for e in entries)
        room = max(total // BINS_SHARE, BINS_BYTES)  # for one call's bins: a byte per element and series
        most = room // len(histograms.KEYS) if self.binned else math.inf
        for key, members in kinds.items():
            for span in flat_chunks([e.p.numel() for e in members], most, CHUNK):
                part = members[span.start:span.stop]
                after = [e.p for e in part]
                grads, present = _grads(after)
                if key[-1]:
                    rows, exact, bins = self.fuser(snapshotted, [e.snapshot.before for e in part], after, grads,
                                                   self.binned, device=key[1])
                    for e, value in zip(part, exact.unbind()):
                        e.pieces["exact"] = value.reshape(1)
                else:
                    bounds = []
                    for e in part:
                        assert e.extremes is not None  # taken by before() for each entry the view rebuilds
                        bounds.append(e.extremes)
                    rows, bins = self._rebuilt_rows(part[0].group, after, [state.get(p, {}) for p in after], grads,
                                                    bounds)
                _put(batch, part, rows, stats.KINDS if key[-1] else stats.KINDS[1:], present)
                if bins is not None:
                    binning.bin_whole(part, bins, present)

    def _rebuilt_rows(self, group: dict[str, Any], after: list[Tensor], states: list[dict[str, Any]],
                      grads: list[Tensor], extremes: list[Tensor]) -> tuple[Tensor, Bins | None]:
        """The grad and u rows of a chunk of parameters the view rebuilds, and their bins where
        histograms are on (:func:`inverted`).

        Through the view's fused form, or, where it has none for these states, from the view's
        eager rebuild and inversion."""
        form = self.view.fused(group, after, states)
        if form is not None:
            return self.fuser(inverted, *form, torch.stack(extremes), after, grads, self.binned,
                              device=after[0].device)
        changes = []
        for p, result, bound in zip(after, rebuild(self.view, group, after, states, [None] * len(after)), extremes):
            u = stored_change(p, result, None, bound.to(p.dtype), meant=False)[0]
            changes.append(torch.zeros_like(p) if u is None else u)
        return grad_and_change_rows(grads, changes), bins_of(changes, after, grads, self.binned)


def device_chunks(entries: list[Entry]) -> Iterator[list[Entry]]:
    """``entries`` by device, in chunks of at most :data:`CHUNK`."""
    by_device: dict[torch.device, list[Entry]] = {}
    for e in entries:
        by_device.setdefault(e.p.device, []).append(e)
    for members in by_device.values():
        for i in range(0, len(members), CHUNK):
            yield members[i:i + CHUNK]


def _grads(params: list[Tensor]) -> tuple[list[Tensor], list[bool]]:
    """Each parameter's grad after the step, dense, and whether it has one.

    A sparse grad (of a parameter captured flat) is made dense; a missing one (no grad, or a step
    that dropped it) is zeros, and its grad's rows are left out."""
    grads = [p.grad for p in params]
    present = [g is not None for g in grads]
    if all(g is not None and g.layout is torch.strided for g in grads):  # all present and dense
        return cast(list[Tensor], grads), present
    return ([torch.zeros_like(p) if g is None else g if g.layout is torch.strided else g.to_dense()
             for p, g in zip(params, grads)], present)


def _put(batch: stats.Batch, chunk: list[Entry], rows: Tensor, kinds: tuple[str, ...], present: list[bool],
         counts: list[int] | None = None) -> None:
    """Put a chunk's ``(len(kinds), k, 3)`` rows into its entries' slots of those kinds.

    A parameter whose step left it without a grad (not ``present``) gets no grad row; ``counts``:
    the entries' element counts, where known."""
    counts = counts if counts is not None else [stats.count(e.p) for e in chunk]
    with_grad = [i for i, has in enumerate(present) if has]
    for kind, table in zip(kinds, rows.unbind(0)):
        if kind == "grad" and len(with_grad) < len(chunk):
            batch.put(table[with_grad], [counts[i] for i in with_grad], [chunk[i].slots[kind] for i in with_grad])
        else:
            batch.put(table, counts, [e.slots[kind] for e in chunk])

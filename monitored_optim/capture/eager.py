"""The eager routes: per part, the view's snapshot before the step and its stored change after.

The routes ``SNAPSHOT``, ``VIEW`` and ``CLONED`` of :mod:`~monitored_optim.capture.route`, and the
``FUSED_REBUILD`` entries' snapshots: a few ops per part, for every optimizer, dtype and layout.
The stored changes of one chunk of parts (:func:`chunks`) are alive at once; their sums go to the
logging step's :class:`~monitored_optim.stats.Batch` and their device pieces to the parameter's entry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .. import histograms, pieces, stats
from ..families.base import Family
from ..updates import Cloned, Rows, Summed, View, rebuild
from ..updates.clone import fetched
from .binning import Tally
from .plan import Entry
from .rules import HALF_ULP, LOW_PRECISION, CentringMemory, at_powers_of_two, at_powers_of_two_bound
from ..workspace import Workspace
from .change import Part, bounds, exact_change, lost, stored_change, verify_miss, widened


class Eager:
    """The eager routes of one monitor.

    Args:
        view: the monitor's update view.
        verify: verify mode (``MonitorConfig.verify``): compare each rebuilt update with a clone.
        families: the figure families whose ``part`` hook sees each stored change.
        reductions: key head -> reduction of every device piece (``heads`` of :class:`monitored_optim.pieces.Keys`).
        centring: the centring rule's memory.
    """

    def __init__(self, view: View, verify: bool, families: list[Family], reductions: dict[str, str],
                 centring: CentringMemory) -> None:
        self.view, self.verify, self.families = view, verify, families
        self.reductions, self.centring = reductions, centring
        self.binned = any(fam.binned for fam in families)  # p, grad and u binned (the histograms family)
        self.tally = Tally()  # the logging step's histograms of parts
        self.reads_parts = any(type(fam).part is not Family.part for fam in families)  # a family's part hook
        self.reads_u = self.binned or self.reads_parts  # each stored change is formed
        self.shared: set[int] = set()  # ids of this step's parameters whose storage is shared

    def entry(self, name: str, group: dict[str, Any], part: Part, reason: str | None, lead: Entry | None,
              fuse: bool = False, work: Workspace | None = None) -> Entry:
        """The entry of one part, with p_before held as its route needs.

        ``reason`` (the snapshot rule's, or ``"clone"``) makes a copy of p_before; the view still runs
        where its intended update is needed (bf16/fp16 ``update_lost``, verify mode), except for a
        clone. ``fuse``: the fused route takes the entry where the view's snapshot is a copy or nothing.
        """
        if reason == "clone" or (reason is not None and not (self.verify or part.p.dtype in LOW_PRECISION)):
            return Entry(name, group, part.p, Cloned.of(part.p), part, lead)
        e = Entry(name, group, part.p, self.view.before(group, part.p, part.state), part, lead)
        if isinstance(e.snapshot, Summed) and self.reads_u:  # the sums alone do not serve a family's part hook
            e.snapshot = Cloned.of(part.p)
        e.fused = fuse and (e.snapshot is None or isinstance(e.snapshot, Cloned))
        if e.fused:  # its bounds come from the fused route
            return e
        if reason is not None and not isinstance(e.snapshot, Cloned):
            e.kept = part.p.detach().clone()
        if e.before is None and not isinstance(e.snapshot, Summed):  # the inversion's bounds
            e.extremes = bounds(part.p)
            exact = at_powers_of_two_bound(part.p, e.extremes, work)
            if exact is not None:
                self.add_piece(e.owner, "exact", exact)
        if self.verify and e.before is None:
            e.kept, e.verifies = part.p.detach().clone(), True
        return e

    def before(self, batch: stats.Batch, entries: list[Entry], grad_scale: Tensor | None, grads: bool) -> None:
        """The sums of p_before and, where ``grads``, of each grad as the step uses it, into ``batch``."""
        record(batch, entries, "p", [e.p for e in entries], self.centred(entries, "p"))
        if grads:
            self.grads(batch, entries, grad_scale, self.centred(entries, "grad"))

    def grads(self, batch: stats.Batch, entries: list[Entry], grad_scale: Tensor | None,
              centre: list[bool] | None = None) -> None:
        """The sums of each grad as the step uses it (:func:`record_grads`) and, where histograms are
        on, its counts (replacing those of grads recorded before: a closure makes new ones)."""
        record_grads(batch, entries, grad_scale, centre)
        if not self.binned:
            return
        scale = None if grad_scale is None else grad_scale.detach().float().reciprocal()
        series = histograms.KEYS["grad"]
        for e in entries:
            self.tally.drop(e.owner, series)
        for e in entries:
            if e.p.grad is not None:
                self.tally.add(e.owner, series, e.p.grad, scale, batch.work)

    def after(self, chunk: list[Entry], states: list[dict[str, Any]], batch: stats.Batch) -> None:
        """Measure the stored change of each part of one chunk; its sums go to ``batch``.

        The chunk is of one param group and device; each change is rebuilt by the view or taken
        from the snapshot. The chunk's temporaries die on return."""
        assert batch.work is not None  # a logging step's batch has its workspace
        batch.work.reset()  # the last chunk's stored changes are reduced
        viewed = [i for i, e in enumerate(chunk) if not isinstance(e.snapshot, Cloned)]
        params, views = zip(*[widened(chunk[i].p, states[i]) for i in viewed]) if viewed else ((), ())
        rebuilt = dict(zip(viewed, rebuild(self.view, chunk[0].group, list(params), list(views),
                                           [chunk[i].snapshot for i in viewed])))
        jobs = []
        for i, e in enumerate(chunk):
            result = rebuilt.get(i)
            if isinstance(result, Summed) and e.before is None:  # the replayed change's sums are its figures
                self._summed(e, result, batch)
                if e.verifies:
                    e.kept = None  # verify mode's copy, checked
                continue
            result = None if isinstance(result, Summed) else result  # a copy of p_before was taken: u from it
            if isinstance(result, Rows):  # one slice at a time, each reduced before the next is built
                for span, piece in result.slices():
                    u = self._stored(e, piece, span)
                    if u is not None:
                        record(batch, [e], "u", [u], self.centred([e], "u"), scratch=True)
            else:
                u = self._stored(e, result, state=states[i], work=batch.work)
                if u is not None:
                    jobs.append((e, u))
            if e.verifies:
                e.kept = None  # verify mode's copy, checked
        centre = self.centred([e for e, _ in jobs], "u")
        record(batch, [e for e, _ in jobs], "u", [u for _, u in jobs], centre, scratch=True)

    def _summed(self, e: Entry, result: Summed, batch: stats.Batch) -> None:
        """Add a part's :class:`~monitored_optim.updates.clone.Summed` to its ``"u"`` slot; in verify
        mode, add the miss of the norm it gives against the clone's as the ``verify`` piece."""
        batch.put(result.row.reshape(1, 3), [result.n], [e.owner.slots["u"]])
        e.owner.centred["u"] = True
        if e.clone is not None:
            c, r, q = result.row.unbind()
            norm = (q.square() + 2 * c * r + result.n * c.square()).clamp(min=0).sqrt()
            truth = torch.linalg.vector_norm(Cloned(e.clone).update(e.p).double())
            self.add_piece(e.owner, "verify", torch.stack([(norm - truth).abs(), truth]))

    def _stored(self, e: Entry, result: Any, span: slice | None = None,
                state: dict[str, Any] | None = None, work: Workspace | None = None) -> Tensor | None:
        """The stored change of entry ``e``, or of its flat slice ``span``, from the view's ``result``.

        Adds its ``lost``, ``exact`` and ``verify`` pieces, and the families' device pieces, to the
        parameter's entry."""
        def cut(t: Tensor | None) -> Tensor | None:
            return t if t is None or span is None else t.detach().view(-1)[span]

        p = e.p if span is None else e.p.detach().view(-1)[span]
        before, clone = cut(e.before), cut(e.clone)
        before = before if before is None else fetched(before, p)  # a staged snapshot, back one part at a time
        u, meant = stored_change(p, result, before, e.extremes, work, meant=self.verify or p.dtype in LOW_PRECISION)
        if self.binned:
            if u is None:
                self.tally.add_zeros(e.owner, histograms.KEYS["u"], p)
            else:  # formed in float64 where p_before is held (exact also where it crosses 0)
                self.tally.add(e.owner, histograms.KEYS["u"], u if before is None else exact_change(p, before),
                               work=work)
            self.tally.add(e.owner, histograms.KEYS["param"], p, work=work)
        if u is None:  # the view says nothing moved; verify mode checks that against its clone
            if clone is not None:
                moved = Cloned(clone).update(p)
                self.add_piece(e.owner, "verify", verify_miss(torch.zeros_like(moved), moved, None, p))
            return None
        if p.dtype in LOW_PRECISION:
            self.add_piece(e.owner, "lost", lost(u, meant, cut(e.p.grad)))
        elif before is not None and e.whole.dim() >= 2 and p.dtype in HALF_ULP:  # may it go back to the
            self.add_piece(e.owner, "exact", at_powers_of_two(before, p))  # inversion? (inverted parts
            # measured at_powers_of_two_bound before the step, in entry)
        truth = u if before is not None else (None if clone is None else Cloned(clone).update(p))
        if truth is not None and self.verify:  # shared storage changes by every sharer's update:
            checked = None if id(e.whole) in self.shared else meant  # not one view's to check
            self.add_piece(e.owner, "verify", verify_miss(u, truth, checked, p))
        assert e.part is not None  # every eager entry is made from its part (entry())
        where = span if span is not None else e.part.flat_span()
        for fam in self.families:
            for key, value in fam.part(e.name, e.part.whole, u, where, {} if span is not None else state or {},
                                       e.group).items():
                self.add_piece(e.owner, key, value)
        return u

    def add_piece(self, e: Entry, key: str, value: Tensor) -> None:
        """Add a part's device piece into its parameter's entry, by the key's declared reduction."""
        pieces.accumulate(e.pieces, key, value, self.reductions)

    def centred(self, entries: list[Entry], kind: str) -> list[bool]:
        """Per entry, whether its ``kind`` moments take the centred pass."""
        return self.centring.flags((e.name for e in entries), kind)


def chunks(entries: list[Entry], budget: int) -> Iterator[list[Entry]]:
    """Consecutive entries of one param group and device whose parts together take at most ``budget``
    bytes (or one larger part): their stored changes are alive at once, so the few temporaries of a
    chunk are a logging step's extra memory."""
    chunk: list[Entry] = []
    size = 0
    for e in entries:
        if chunk and (size + _nbytes(e.p) > budget or e.group is not chunk[0].group
                      or e.p.device != chunk[0].p.device):
            yield chunk
            chunk, size = [], 0
        chunk.append(e)
        size += _nbytes(e.p)
    if chunk:
        yield chunk


def _nbytes(p: Tensor) -> int:
    return p.numel() * p.element_size()


def record(batch: stats.Batch, entries: list[Entry], kind: str, xs: list[Tensor], centre: list[bool],
           scale: stats.Scale = None, scratch: bool | list[bool] = False) -> None:
    """Add the sums of ``xs`` (one per entry) to ``batch``, each into its parameter's ``kind`` slot."""
    batch.add(xs, centre, scale, scratch, into=[e.owner.slots[kind] for e in entries])
    temporary = [scratch] * len(xs) if isinstance(scratch, bool) else scratch  # centred in place by the batch
    for e, flag, own in zip(entries, centre, temporary):
        e.owner.centred[kind] = flag or own


def record_grads(batch: stats.Batch, entries: list[Entry], grad_scale: Tensor | None,
                 centre: list[bool] | None = None) -> None:
    """Sums of each ``p.grad`` as the step uses it, into a new ``"grad"`` slot per parameter:
    unscaled when a fused GradScaler step passes its scale; nothing where the grad is ``None``."""
    flags = centre if centre is not None else [True] * len(entries)
    for e in entries:
        if e.lead is None:
            e.slots["grad"] = batch.slot()
    with_grad = [(e, c, g) for e, c in zip(entries, flags) if (g := e.p.grad) is not None]
    scale = None if grad_scale is None else grad_scale.detach().double().reciprocal()  # sums are linear
    record(batch, [e for e, _, _ in with_grad], "grad", [g for _, _, g in with_grad],
           [c for _, c, _ in with_grad], scale)

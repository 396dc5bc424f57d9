"""The stored change: parts of large parameters, the inversion of the store's rounding, verify.

* **Inversion** (:func:`stored_change`): for the matrices the snapshot rule leaves to the view
  (:mod:`monitored_optim.capture.rules`), the view's update is turned into the stored change by
  inverting the store's rounding in the parameter's own dtype:
  p_before = fl(fl(p_after - d) / s) for p_after = fl(fl(s·p_before) + d) (s = 1 - lr·λ under
  decoupled weight decay, else 1), then u = p_after - p_before (exact by Sterbenz's lemma).
* **Parts** (:func:`parts`): a parameter of more than ``PART_ELEMENTS`` elements whose view
  is element-wise is reduced one flat slice at a time, so that no temporary is larger than a slice
  (the first logging step included).

Source of the rounding facts: IEEE 754 round-to-nearest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..updates import Scaled, Stores
from ..workspace import PART_ELEMENTS
from ..workspace import Workspace, room
from .rules import LOW_PRECISION, eps

@dataclass(slots=True)
class Part:
    """One slice ``span`` of the parameter ``whole``, as a view to hand to an update view: ``p`` (a
    detached view whose ``.grad`` is the matching slice of the grad) and ``state`` (each tensor
    shaped like the parameter sliced the same way; scalars and other tensors as they are). The
    slice is of the flattened parameter (``flat``) or, for a non-contiguous one, of its first
    dimension. A whole parameter is its own single part (``span`` None, ``p`` the parameter)."""

    p: Tensor
    state: dict[str, Any]
    whole: Tensor
    span: slice | None = None
    flat: bool = True

    def flat_span(self) -> slice | None:
        """The elements of the flattened parameter this part covers (None for a whole parameter)."""
        if self.span is None or self.flat:
            return self.span
        cols = self.whole.numel() // self.whole.shape[0]
        return slice(self.span.start * cols, self.span.stop * cols)

    def regrad(self) -> None:
        """Point ``p.grad`` at the slice of the parameter's grad now (a closure may have made a new one
        since the part was cut)."""
        if self.span is not None:
            grad = self.whole.grad
            self.p.grad = None if grad is None else _cut(grad, self.span, self.flat)

    def refresh(self, state: dict[str, Any]) -> dict[str, Any]:
        """After the step: :meth:`regrad` and return the slice of the post-step ``state`` (created
        lazily by the first step)."""
        if self.span is None:
            return state
        self.regrad()
        self.state = _slice_state(state, self.whole, self.span, self.flat)
        return self.state


def budget(total_bytes: int) -> int:
    """Bytes of parameters rebuilt at once on a logging step: 1/64 of the monitored parameters'
    bytes, at least 256 KiB and at most 1 MiB (``PART_ELEMENTS`` of float32), so that the few
    temporaries of a chunk stay a small share of a small model and a few MiB of a large one."""
    return min(max(total_bytes // 64, 1 << 18), PART_ELEMENTS * 4)


def parts(p: Tensor, state: dict[str, Any], cut: bool, limit: int = PART_ELEMENTS) -> list[Part]:
    """``p`` as a list of parts: slices of at most ``limit`` elements, or ``[Part(p, state, p)]``.

    A row of the first dimension larger than ``limit`` makes a part of its own.

    Only where the plan cuts p (``cut``: its :func:`slices` for ``limit`` are more than 1, an
    element-wise view's large parameter) and the grad is dense. Slices are flat where p, its grad
    and its p-shaped state are all contiguous, else along the first dimension.
    """
    grad = p.grad
    shaped = [v for v in state.values() if isinstance(v, Tensor) and v.shape == p.shape]
    if not cut or (grad is not None and grad.is_sparse) \
            or any(v.is_sparse for v in shaped):
        return [Part(p, state, p)]
    flat = all(t.is_contiguous() for t in [p, *shaped, *([] if grad is None else [grad])])
    if not flat and p.dim() < 2:
        return [Part(p, state, p)]
    rows, cols = _rows(p, limit)
    length, step = (p.numel(), rows * cols if cols <= limit else limit) if flat else (p.shape[0], rows)
    out = []
    for start in range(0, length, step):
        span = slice(start, min(length, start + step))
        piece = _cut(p.detach(), span, flat)
        piece.grad = None if grad is None else _cut(grad, span, flat)
        out.append(Part(piece, _slice_state(state, p, span, flat), p, span, flat))
    return out


def slices(p: Tensor, elementwise: bool, limit: int = PART_ELEMENTS) -> int:
    """How many parts :func:`parts` cuts ``p`` into where its grad and state are dense and it, its
    grad and its p-shaped state are contiguous (1: it is not cut)."""
    n = p.numel()
    if not elementwise or n <= limit or p.dim() == 0:
        return 1
    rows, cols = _rows(p, limit)
    return -(-n // (rows * cols if cols <= limit else limit))


def _rows(p: Tensor, limit: int) -> tuple[int, int]:
    """``(rows, cols)``: the whole rows of the first dimension a part of ``p`` holds where a row fits
    in ``limit`` elements (spectral's products; else 1), and the elements of a row."""
    cols = p.numel() // p.shape[0] if p.dim() >= 2 else 1
    return max(1, limit // cols), cols


def _cut(t: Tensor, span: slice, flat: bool) -> Tensor:
    return t.view(-1)[span] if flat else t[span]


def _slice_state(state: dict[str, Any], p: Tensor, span: slice, flat: bool) -> dict[str, Any]:
    return {k: (_cut(v, span, flat) if isinstance(v, Tensor) and v.shape == p.shape else v) for k, v in state.items()}


def widened(p: Tensor, state: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
    """A bf16/fp16 part and its state as float32 copies (``.grad`` too); others as they are.

    An update view then computes the intended update in torch's own arithmetic precision (its kernels compute in float32
    and round once into the stored dtype; in bf16/fp16 a small update such as 3e-7 · 1e-2 would
    underflow to zero before it could be compared with the stored change)."""
    if p.dtype not in LOW_PRECISION:
        return p, state
    wide = p.detach().float()
    wide.grad = None if p.grad is None else p.grad.float()
    return wide, {k: (v.float() if isinstance(v, Tensor) and v.dtype in LOW_PRECISION else v) for k, v in state.items()}


def _dense_into(d: Scaled, work: Workspace | None) -> Tensor:
    """``d.dense()``, into ``work``'s :meth:`~monitored_optim.workspace.Workspace.one` where its result
    has the tensor's dtype."""
    t = d.tensor
    if work is None or t.is_sparse or torch.result_type(t, d.factor) != t.dtype:
        return d.dense()
    return d.dense(out=work.one(t))


def stores(intended: Tensor | Scaled | Stores, work: Workspace | None = None, factored: torch.dtype | None = None
           ) -> tuple[list[tuple[Tensor, float]], float | Tensor]:
    """``(adds, s)`` of an update view's result: p_after = fl(...fl(fl(s·p_before) + d_1)... + d_k),
    each d as a pair ``(t, a)``, d = a·t: a dense tensor and 1 (new, the view's own, or, given
    ``work``, a :class:`~monitored_optim.workspace.Workspace` buffer for the first
    :class:`~monitored_optim.updates.clone.Scaled` one formed), or, for a
    :class:`~monitored_optim.updates.clone.Scaled` of a Python factor whose dense tensor has dtype
    ``factored``, its tensor and factor, not formed (for ``torch.sub(p, t, alpha=a)``)."""
    if not isinstance(intended, Stores):
        intended = Stores((intended,))
    adds, used = [], False
    for d in intended.adds:
        if isinstance(d, Scaled) and isinstance(d.factor, (int, float)) and d.tensor.dtype == factored \
                and not d.tensor.is_sparse:
            adds.append((d.tensor, d.factor))
            continue
        if isinstance(d, Scaled):
            d, used = _dense_into(d, None if used else work), True
        adds.append((d.to_dense() if d.is_sparse else d, 1))
    return adds, intended.s


def bounds(p: Tensor) -> Tensor | None:
    """``[min, max]`` of a part before the step, or None.

    One reduction, no temporary; of the real and the imaginary parts apart for a complex part,
    shape (2, 2). Where they are equal the part was
    constant (a matrix initialised at 1.0 or 0) and p_before is that value exactly, which the
    inversion cannot tell from its neighbour where the step crosses a power of two. None for an
    empty part."""
    x = p.detach()
    if x.numel() == 0:
        return None
    return torch.stack(torch.aminmax(torch.view_as_real(x).reshape(-1, 2), dim=0) if x.is_complex()
                       else torch.aminmax(x))


def stored_change(p: Tensor, intended: Tensor | Scaled | Stores | None, before: Tensor | None,
                  extremes: Tensor | None = None, work: Workspace | None = None, meant: bool = True
                  ) -> tuple[Tensor | None, Tensor | None]:
    """The stored change u = p_after - p_before of one part, and the intended update it came from.

    Args:
        p: the part after the step (any floating or complex dtype).
        intended: the view's result (None: the step left ``p`` unchanged; a view's own clone
            fallback passes None with ``before``).
        before: the exact snapshot of p_before, or None to invert the rounding (float32/float64).
        extremes: :func:`bounds` of p_before, for the inversion.
        work: where the inversion's temporaries go (:class:`~monitored_optim.workspace.Workspace`; u
            then lives until its ``reset``); None: new tensors.
        meant: whether to return the intended update. Without it the inversion subtracts a
            :class:`~monitored_optim.updates.clone.Scaled` d = f·r with a Python factor as ``torch.sub(p, r, alpha=f)``,
            one op and no temporary for d (the SGD store's own form, ``p.add_(buf, alpha=-lr)``).

    Returns:
        ``(u, meant)``: u as a new tensor (float32 for bf16/fp16 parameters; None where nothing
        moved and there is no snapshot), and the update the optimizer meant, Σ d + (s - 1)·p_before,
        which :func:`lost` and :func:`verify_miss` compare with u (None when ``intended`` is None,
        for an inverted update with weight decay, whose p_before is not kept, and where ``meant``
        is False).
    """
    after = p.detach()
    if intended is None:
        return (None if before is None else _wide(after) - _wide(before)), None
    if before is not None:
        adds, s = stores(intended)
        u = _wide(after) - _wide(before)
        total = _total([_wide(d) for d, _ in adds])
        return u, (total if _is_one(s) else total + (s - 1) * _wide(before))
    adds, s = stores(intended, work, None if meant or after.is_complex() else after.dtype)
    real = torch.view_as_real if after.is_complex() else (lambda t: t)
    p_b = real(after)
    for k, (d, alpha) in enumerate(reversed(adds)):  # one rounding in p's dtype each: the nearest value
        d = real(d.to(after.dtype))                   # to p - d; the first makes the copy, the others go into it
        p_b = p_b.sub_(d, alpha=alpha) if k else torch.sub(p_b, d, alpha=alpha, out=room(p_b, work))
    if not _is_one(s):  # p_b is the loop's own tensor (every view stores at least one d)
        p_b.div_(s.to(p_b.dtype) if isinstance(s, Tensor) else s)
    if extremes is not None:  # a constant p_before (min = max) was exactly that value (a select: NaNs stay put)
        torch.where(extremes[0] == extremes[1], extremes[0].to(p_b.dtype), p_b, out=p_b)
    u = torch.sub(real(after), p_b, out=p_b)
    u = torch.view_as_complex(u) if after.is_complex() else u
    return u, (_total([d for d, _ in adds]) if meant and _is_one(s) else None)


def exact_change(p: Tensor, before: Tensor) -> Tensor:
    """p - p_before in float64 (complex128 for a complex p): the change a histogram counts where
    p_before is held, exact for float32 and narrower values, also where it crosses 0."""
    wide = torch.complex128 if p.is_complex() else torch.float64
    return p.detach().to(wide) - before.to(wide)


def _total(adds: list[Tensor]) -> Tensor:
    return adds[0] if len(adds) == 1 else torch.stack(adds).sum(0)


def _wide(t: Tensor) -> Tensor:
    """``t`` in float32 if bf16/fp16 (a copy), else as it is."""
    return t.float() if t.dtype in LOW_PRECISION else t


def lost(u: Tensor, meant: Tensor | None, grad: Tensor | None) -> Tensor:
    """Elements the optimizer meant to move whose stored value did not change: a float64 count of
    shape (1,). Without the intended update (no state-aware view), elements with a non-zero grad."""
    if meant is None:
        if grad is None:
            return u.new_zeros(1, dtype=torch.float64)
        meant = grad.to_dense() if grad.is_sparse else grad
    return ((u == 0) & (meant != 0)).sum().double().reshape(1)


def verify_miss(u: Tensor, truth: Tensor, meant: Tensor | None, p: Tensor) -> Tensor:
    """Verify mode: ``[||miss||, ||truth||]`` (float64, shape (2,)) of a part against the clone's
    ``truth``. Per element, miss is the larger of the figure's error ``|u - truth|`` and the view's
    error beyond what the store's rounding explains, ``max(|meant - truth| - r, 0)`` with
    ``r = eps·(|p_after| + |p_before|) / 2`` (half a spacing of each value; ``meant`` None: no view)."""
    err = (u.to(truth.dtype) - truth).abs()
    if meant is not None:
        after = p.detach().to(truth.dtype)
        r = eps(p.dtype) * (after.abs() + (after - truth).abs()) / 2
        err = torch.maximum(err, ((meant.to(truth.dtype) - truth).abs() - r).clamp_(min=0))
    return torch.stack([torch.linalg.vector_norm(err), torch.linalg.vector_norm(truth)]).double()


def _is_one(s: float | Tensor) -> bool:
    return not isinstance(s, Tensor) and s == 1.0

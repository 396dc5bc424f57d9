"""Capture: which parameters are snapshotted, how large ones are cut into parts, and the stored change.

The truth of every figure is the change of the *stored* parameter, u = p_after - p_before. A
state-aware view gives the update the optimizer computed; the stored value differs from
p_before + that update by the rounding of the store, and that rounding does not average out where
values are constant (every element of a LayerNorm gain at 1.0 rounds the same way) or where the
update is a few units in the last place (warmup learning rates, bf16). So:

* **Snapshot rule** (:func:`snapshot_reason`): an exact copy of p_before is taken, on logging
  steps only, for a parameter that is a *vector* (ndim < 2: biases, norm gains, scalars, where
  constant initialisation lives and which hold about 0.1% of a transformer's bytes), is *bf16 or
  fp16* (the store's spacing, 2^-8 relative for bf16, makes power-of-two crossings common, and
  there the rounding cannot be inverted: two p_before map to one p_after), is complex, *shares
  its storage* with another monitored parameter, or is a float32/float64 matrix whose values sit
  so close to a power of two that crossings would matter (near-constant ones; a block at 1.0): as
  the last logging steps measured (:func:`rounding_risk`, :func:`at_powers_of_two`, for
  :data:`SNAPSHOT_FOR` logging steps after the last risky one), or, before the first, as found when
  the optimizer is built (:func:`risky_when_built`).
* **Inversion** (:func:`stored_change`): for the other matrices the view's update is turned into
  the stored change by inverting the store's rounding in the parameter's own dtype:
  p_before = fl(fl(p_after - d) / s) for p_after = fl(fl(s·p_before) + d) (s = 1 - lr·λ under
  decoupled weight decay, else 1), then u = p_after - p_before (exact by Sterbenz's lemma).
* **Parts** (:func:`parts`): a parameter of more than :data:`PART_ELEMENTS` elements whose view
  is element-wise is reduced one flat slice at a time, so that no temporary is larger than a slice
  (the first logging step included).

Source of the rounding facts: IEEE 754 round-to-nearest; ``shared/reference/update-formulas.md`` §3.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .updates import Scaled, Stores
from .updates._shared import PART_ELEMENTS

LOW_PRECISION = (torch.float16, torch.bfloat16)


RISK_ABOVE = 1e-4
""":func:`rounding_risk` above which a float32/float64 matrix is snapshotted at the next logging step:
the estimated share of ||u||^2 the inversion may miss, 1e-4 of it being 5e-5 of the norm (half the
1e-4 tolerance). A matrix at 1.0 after one SGD step of lr 1e-4 scores about 1e-2; N(0, 0.02)
weights at lr 3e-7 about 1e-12; weights whose updates mostly round away about 1e-6."""


def snapshot_reason(p: Tensor, aliased: bool, risky: bool) -> str | None:
    """Why ``p`` gets an exact snapshot of p_before on this logging step, or None (the view's update,
    rounding inverted). The one rule of the module docstring.

    Args:
        p: the parameter (any shape, floating or complex dtype).
        aliased: another monitored parameter shares ``p``'s storage (a tensor listed twice, views
            of one buffer): the optimizer's updates of both land in the same memory.
        risky: :func:`rounding_risk` of one of the last :data:`SNAPSHOT_FOR` logging steps, or,
            before the first, :func:`risky_when_built`.

    Returns:
        ``"aliased"``, ``"vector"``, ``"low precision"``, ``"complex"`` (its real and imaginary parts
        have spreads of their own, which the pairs-of-reals moments that :func:`rounding_risk` reads
        do not tell apart), ``"rounding risk"`` or None.
    """
    if aliased:
        return "aliased"
    if p.dim() < 2:
        return "vector"
    if p.dtype in LOW_PRECISION:
        return "low precision"
    if p.is_complex():
        return "complex"
    return "rounding risk" if risky else None


def rounding_risk(eps: Tensor, mean_sq_p: Tensor, std_p: Tensor, std_u: Tensor, sq_u: Tensor | None = None,
                  exact: Tensor | None = None) -> Tensor:
    """Whether an inversion of the store may miss more than the tolerances allow, per parameter.

    A store's spacing is about eps·|p|, and an element can be recovered wrongly by up to one spacing
    only where the spacing changes: where the step crossed a power of two, or where p sits exactly
    at one (p_before = 1.0 with an update below half a spacing stays at 1.0 and is recovered as
    1 - eps/2; one moving up from it is recovered from below). Two measures:

    * spread values crossing a power of two, whose misses fall either way: their share of ||u||^2,
      estimated from the moments as eps^2 · E[p^2] / (std(u) · std(p)) (a fraction of about
      std(u) / std(p) of the elements cross); above :data:`RISK_ABOVE`. No update (std(u) zero or
      undefined) is no risk here;
    * elements exactly at a power of two before or after the step (``exact``,
      :func:`at_powers_of_two`, or :func:`at_powers_of_two_bound` in the eager inversion, where
      the last logging step measured it, NaN elsewhere): their misses
      lean one way (a block at 1.0 moves together), so they bound the relative error of ||u|| at
      first order, eps · sqrt(exact) / ||u||; above :data:`ALIGNED_ABOVE`, also where nothing else
      moved.

    Args:
        eps, mean_sq_p, std_p, std_u: float64 tensors of one shape: each parameter's :func:`eps`,
            E[p^2], std(p) and std(u) from the last logging step.
        sq_u, exact: float64 tensors of that shape, ||u||^2 and :func:`at_powers_of_two`, or None.

    Returns:
        Bool tensor of that shape.
    """
    moved = std_u.nan_to_num(nan=0.0) > 0
    share = (eps * eps * mean_sq_p / (std_u * std_p)).nan_to_num(nan=0.0, posinf=1.0)
    risky = moved & (share > RISK_ABOVE)
    if sq_u is not None and exact is not None:
        risky |= (eps * exact.sqrt() / sq_u.sqrt()).nan_to_num(nan=0.0, posinf=1.0) > ALIGNED_ABOVE
    return risky


ALIGNED_ABOVE = 5e-5
""":func:`rounding_risk`'s first-order bound (elements exactly at a power of two) above which a matrix
is snapshotted: half the 1e-4 tolerance on norms."""


HALF_ULP = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
"""Per dtype, half the spacing of its values just above 1.0: 2^-(mantissa width + 1)."""


def mantissa_gap(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``fl(x + x·h) - x`` with h = :data:`HALF_ULP` of x's dtype, elementwise: 0 where x has no
    mantissa bits (±2^k, and 0), nonzero where it has some and |x| >= 2^-102 (float32; 2^-969 for
    float64), NaN at ±inf and NaN.

    There x·h is exact (a power-of-two scaling) and half a spacing of x or more: at ±2^k exactly
    half, a tie that rounds to x's even neighbour, x itself; above 2^k more than half, which rounds
    to the next value. Below that x·h rounds (or underflows), and the gap can be 0 for any value,
    always for subnormals: harmless for the sums of squares this test serves, which are 0 there.
    Only element-wise float ops: a bit view of x kept inductor from fusing the test into the pass
    that reads x for its sums (:func:`~monitored_optim.fused.prior`), and compiled code must keep
    IEEE semantics (``fused.INDUCTOR``: GCC's unsafe math turns this into x·h, never 0). Eagerly,
    two ops where the bit test took one (a 64K-element part's :func:`at_powers_of_two_bound`: 65
    against 62 µs).

    Args:
        x: a float32/float64 tensor (any shape).
        out: a tensor of x's shape and dtype for the result, or None (a new one).

    Raises:
        KeyError: another dtype (:data:`HALF_ULP` has none for it).

    Source: IEEE 754 round-to-nearest, ties to even.
    """
    return torch.add(x, x, alpha=HALF_ULP[x.dtype], out=out).sub_(x) if out is not None \
        else x + x * HALF_ULP[x.dtype] - x


def at_powers_of_two(before: Tensor, after: Tensor) -> Tensor:
    """Σ p_after^2 over the elements exactly at a power of two (no mantissa bits) before or after the
    step, where an inversion of the store may miss (:func:`rounding_risk`), float64 of shape (1,).
    Plain torch ops: the fused passes trace the same function; summed in the tensors' dtype, enough
    for a bound.

    Args:
        before, after: float32/float64 tensors of one shape and dtype (a part before and after the
            step: its snapshot, or the inversion's p_before).

    Raises:
        KeyError: another dtype (:func:`mantissa_gap`).
    """
    exact = (mantissa_gap(after) == 0) | (mantissa_gap(before) == 0)
    return torch.where(exact, after, 0).square().sum().double().reshape(1)


SNAPSHOT_FOR = 8
"""Logging steps a float32/float64 matrix stays snapshotted after the last one whose
:func:`rounding_risk` was above its bounds: values leave a power of two and come back (Rprop's
steps back and forth brought a matrix of ±2^k values back onto them two logging steps after a quiet
one, and the inversion missed by 1.9e-4 of the norm), so a matrix goes back to the inversion only
after that many quiet logging steps."""


class RiskMemory:
    """The snapshot rule's memory: the matrices snapshotted for rounding risk, and for how long.

    A name is in it for :data:`SNAPSHOT_FOR` logging steps after the last one whose
    :func:`rounding_risk` was above its bounds, or, before the first, when :func:`risky_when_built`
    found it risky.
    """

    def __init__(self) -> None:
        self._left: dict[str, int] = {}  # name -> logging steps it stays snapshotted

    def __contains__(self, name: object) -> bool:
        return name in self._left

    def mark_when_built(self, named: list[tuple[str, Tensor]]) -> None:
        """Snapshot the parameters that :func:`risky_when_built` finds risky, from the first logging step."""
        flags = risky_when_built([p for _, p in named])
        self._left.update((name, SNAPSHOT_FOR) for (name, _), risky in zip(named, flags) if risky)

    def update(self, names: list[str], position: dict[str, int], eps: Tensor, table: Any, exact: Tensor) -> None:
        """After a logging step: renew the count of the parameters whose rounding risk was above the
        bounds, count down the others it holds that had elements.

        Args:
            names: the parameters' names, the rows of ``table``; ``position``: name -> row.
            eps: float64 ``(N,)``, :func:`eps` of each parameter's dtype.
            table: the step's :class:`~monitored_optim.stats.MomentTable`.
            exact: float64 ``(N,)``, :func:`at_powers_of_two` where measured, NaN elsewhere.
        """
        std, n = table.std, table.n[:, 0]
        risky = rounding_risk(eps, table.sq_norm[:, 0] / n.clamp(min=1), std[:, 0], std[:, 2], table.sq_norm[:, 2], exact)
        hot = {names[i] for i in (risky & (n > 0) & table.has[:, 2]).nonzero().flatten().tolist()}
        self._left.update((name, SNAPSHOT_FOR) for name in hot)
        sizes = n.tolist() if len(self._left) > len(hot) else []
        for name in [name for name in self._left if name not in hot]:  # snapshotted by an earlier logging step
            i = position.get(name)
            if i is not None and sizes[i]:
                if self._left[name] > 1:
                    self._left[name] -= 1
                else:
                    del self._left[name]


NEAR_CONSTANT = 1e-2
"""std(p) / rms(p) below which a float32/float64 matrix counts as near-constant when the optimizer
is built, before any logging step could measure :func:`rounding_risk` (a matrix initialised at 1.0,
or at 1.0 but for a few elements)."""


@torch.no_grad()
def risky_when_built(params: list[Tensor]) -> list[bool]:
    """Per parameter, whether it is a float32/float64 matrix that the snapshot rule takes from the first
    logging step on, until logging steps measure its :func:`rounding_risk`: one whose spread is below
    :data:`NEAR_CONSTANT` of its magnitude (a matrix at 1.0, or at 1.0 but for a few elements), or whose
    elements exactly at a power of two hold more than :data:`RISK_ABOVE` of its squared norm (the
    identity, a block at 1.0): an update smaller than their spacing can land where the inversion
    cannot tell them from a neighbour. A few reductions per such matrix, at most 2^20 elements at a
    time, and one host read, when the optimizer is built (never in a step)."""
    idx = [i for i, p in enumerate(params) if p.dim() >= 2 and p.dtype in HALF_ULP
           and type(p) in (Tensor, torch.nn.Parameter) and p.device.type != "meta" and p.numel() > 1]
    if not idx:
        return [False] * len(params)
    rows = torch.stack([torch.cat([torch.stack(torch.std_mean(params[i].detach(), correction=0)).double(),
                                   _at_powers_of_two(params[i].detach())]) for i in idx]).cpu()
    std, mean, exact, total = rows.unbind(1)
    risky = ((std < NEAR_CONSTANT * (std.square() + mean.square()).sqrt()) | (exact > RISK_ABOVE * total)).tolist()
    out = [False] * len(params)
    for i, flag in zip(idx, risky):
        out[i] = flag
    return out


def at_powers_of_two_bound(p: Tensor, extremes: Tensor | None, work: Workspace | None = None) -> Tensor | None:
    """An upper bound of :func:`at_powers_of_two` (p, p) in a few eager ops, for the eager inversion
    (:func:`at_powers_of_two`'s own eager ops take 75 µs on a 64K-element part): the count of nonzero
    elements exactly at a power of two (:func:`mantissa_gap` 0; ±inf count as not, nor does any
    figure of a part holding them stay finite) times the larger square of p's :func:`bounds`, float64
    of shape (1,). None for a dtype other than float32/float64, without bounds, or for a part larger than ``work``'s
    buffer (the whole matrices of views that are not element-wise: Adafactor's, Muon's): taken a
    slice at a time through the buffer, held before the step, their measurement grew the peak RSS
    of a GPT-2-shaped model's Adafactor logging step from 0.6% to 9.9% of its parameter bytes.

    Args:
        p: a float32/float64 part before the step (any shape).
        extremes: its :func:`bounds`, shape (2,).
        work: whose :meth:`Workspace.one` buffer holds the temporary, or None
            (a temporary of its own: freed between the small allocations of the entries, one grew
            the peak RSS of a GPT-2-shaped model's AdamW logging step by 34%, glibc's heap).
    """
    too_large = work is not None and p.numel() * p.element_size() > work.nbytes
    if p.dtype not in HALF_ULP or extremes is None or too_large:
        return None
    x = p.detach()
    inexact = torch.count_nonzero(mantissa_gap(x, None if work is None else work.one(x)))
    exact = torch.count_nonzero(x) - inexact  # zeros have no mantissa bits either, and no miss
    return (exact * extremes.abs().max().square()).double().reshape(1)


def _slices(x: Tensor, limit: int) -> list[Tensor]:
    """``x`` in consecutive views of at most ``limit`` elements: flat slices where it is contiguous,
    else blocks of whole rows of its first dimension (a row larger than ``limit`` on its own)."""
    if x.dim() < 2 or x.is_contiguous():
        flat = x if x.dim() == 1 else x.reshape(-1)  # a view: 1-D already, or contiguous
        return [flat[start:start + limit] for start in range(0, flat.numel(), limit)]
    rows = max(1, limit // max(1, x[0].numel()))
    return [x[start:start + rows] for start in range(0, x.shape[0], rows)]


def _at_powers_of_two(x: Tensor) -> Tensor:
    """``[:func:`at_powers_of_two` (x, x), Σ x^2]`` of a float32/float64 matrix, float64 of shape (2,),
    at most 2^20 elements at a time."""
    sums = torch.zeros(2, dtype=torch.float64, device=x.device)
    for piece in _slices(x, 1 << 20):
        sums += torch.cat([at_powers_of_two(piece, piece), torch.linalg.vector_norm(piece, dtype=torch.float64)
                           .square().reshape(1)])
    return sums


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
    bytes, at least 256 KiB and at most 1 MiB (:data:`PART_ELEMENTS` of float32), so that the few
    temporaries of a chunk stay a small share of a small model and a few MiB of a large one."""
    return min(max(total_bytes // 64, 1 << 18), PART_ELEMENTS * 4)


def parts(p: Tensor, state: dict[str, Any], elementwise: bool, limit: int = PART_ELEMENTS) -> list[Part]:
    """``p`` cut into slices of at most ``limit`` elements (or of one row of its first dimension
    where a row is larger), or ``[Part(p, state, p)]``.

    Only where the update of a slice depends on nothing but the same slice of p, its grad and its
    state (``elementwise``: the element-wise views) and the grad is dense. Slices are flat where p,
    its grad and its p-shaped state are all contiguous, else along the first dimension.
    """
    n = p.numel()
    grad = p.grad
    shaped = [v for v in state.values() if isinstance(v, Tensor) and v.shape == p.shape]
    if not elementwise or n <= limit or p.dim() == 0 or (grad is not None and grad.is_sparse) \
            or any(v.is_sparse for v in shaped):
        return [Part(p, state, p)]
    flat = all(t.is_contiguous() for t in [p, *shaped, *([] if grad is None else [grad])])
    if not flat and p.dim() < 2:
        return [Part(p, state, p)]
    cols = n // p.shape[0] if p.dim() >= 2 else 1
    rows = max(1, limit // cols)  # whole rows per part where a row fits (spectral's products)
    length, step = (n, rows * cols if cols <= limit else limit) if flat else (p.shape[0], rows)
    out = []
    for start in range(0, length, step):
        span = slice(start, min(length, start + step))
        piece = _cut(p.detach(), span, flat)
        piece.grad = None if grad is None else _cut(grad, span, flat)
        out.append(Part(piece, _slice_state(state, p, span, flat), p, span, flat))
    return out


def _cut(t: Tensor, span: slice, flat: bool) -> Tensor:
    return t.view(-1)[span] if flat else t[span]


def _slice_state(state: dict[str, Any], p: Tensor, span: slice, flat: bool) -> dict[str, Any]:
    return {k: (_cut(v, span, flat) if isinstance(v, Tensor) and v.shape == p.shape else v) for k, v in state.items()}


def widened(p: Tensor, state: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
    """A bf16/fp16 part and its state as float32 copies (``.grad`` too), for an update view to
    compute the intended update in torch's own arithmetic precision (its kernels compute in float32
    and round once into the stored dtype; in bf16/fp16 a small update such as 3e-7 · 1e-2 would
    underflow to zero before it could be compared with the stored change). Others as they are."""
    if p.dtype not in LOW_PRECISION:
        return p, state
    wide = p.detach().float()
    wide.grad = None if p.grad is None else p.grad.float()
    return wide, {k: (v.float() if isinstance(v, Tensor) and v.dtype in LOW_PRECISION else v) for k, v in state.items()}


class Workspace:
    """The buffers of a logging step's part-sized temporaries, reused from part to part.

    A temporary of about 1 MiB that is freed and asked for again between small allocations that
    outlive it (each part's views, its rows of sums) is served by glibc from its heap once the
    first one freed has raised the dynamic mmap threshold, and the small allocations split its
    hole, so that the next temporary does not fit there and the heap grows: measured +6 to +17 MiB
    of peak RSS (up to 3.6% of parameter bytes) on a GPT-2-shaped model with SGD momentum, against
    2.7 MB of tracked temporaries. Two buffers per dtype and device, of ``nbytes`` each (the chunk
    budget, :func:`budget`), made at first use and freed with the logging step, serve them:
    :meth:`one` (a temporary dead before the next is asked for) and :meth:`next` (the stored
    changes of a chunk, alive together until :meth:`reset`). A request that does not fit gets a
    tensor of its own.
    """

    def __init__(self, nbytes: int = PART_ELEMENTS * 4) -> None:
        self.nbytes = nbytes
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}
        self._used = 0

    def one(self, like: Tensor) -> Tensor:
        """A contiguous tensor of ``like``'s shape, dtype and device, valid until the next :meth:`one`."""
        return self._take("one", like, 0)

    def next(self, like: Tensor) -> Tensor:
        """A contiguous tensor of ``like``'s shape, dtype and device, valid until :meth:`reset`."""
        out = self._take("next", like, self._used)
        self._used += like.numel() if out._base is not None else 0  # a slice of the buffer
        return out

    def reset(self) -> None:
        """Hand :meth:`next`'s buffer out again from its start."""
        self._used = 0

    def _take(self, kind: str, like: Tensor, start: int) -> Tensor:
        key, n = (kind, like.dtype, like.device), like.numel()
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(max(n, self.nbytes // like.element_size()),
                                                   dtype=like.dtype, device=like.device)
        if start + n > buf.numel():
            return torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return buf[start:start + n].view(like.shape)


def _room(like: Tensor, work: Workspace | None) -> Tensor:
    """A new tensor like ``like`` (contiguous), or ``work``'s :meth:`~Workspace.next`."""
    return torch.empty_like(like, memory_format=torch.contiguous_format) if work is None else work.next(like)


def _dense_into(d: Scaled, work: Workspace | None) -> Tensor:
    """``d.dense()``, into ``work``'s :meth:`~Workspace.one` where its result has the tensor's dtype."""
    t = d.tensor
    if work is None or t.is_sparse or torch.result_type(t, d.factor) != t.dtype:
        return d.dense()
    return d.dense(out=work.one(t))


def stores(intended: Tensor | Scaled | Stores, work: Workspace | None = None, factored: torch.dtype | None = None
           ) -> tuple[list[tuple[Tensor, float]], float | Tensor]:
    """``(adds, s)`` of an update view's result: p_after = fl(...fl(fl(s·p_before) + d_1)... + d_k),
    each d as a pair ``(t, a)``, d = a·t: a dense tensor and 1 (new, the view's own, or, given
    ``work``, a :class:`Workspace` buffer for the first :class:`Scaled` one formed), or, for a
    :class:`Scaled` of a Python factor whose dense tensor has dtype ``factored``, its tensor and
    factor, not formed (for ``torch.sub(p, t, alpha=a)``)."""
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
    """``[min, max]`` of a part before the step (one reduction, no temporary; of the real and the
    imaginary parts apart for a complex part, shape (2, 2)): where they are equal the part was
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
        work: where the inversion's temporaries go (:class:`Workspace`; u then lives until its
            ``reset``); None: new tensors.
        meant: whether to return the intended update. Without it the inversion subtracts a
            :class:`Scaled` d = f·r with a Python factor as ``torch.sub(p, r, alpha=f)``, one op
            and no temporary for d (the SGD store's own form, ``p.add_(buf, alpha=-lr)``).

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
        p_b = p_b.sub_(d, alpha=alpha) if k else torch.sub(p_b, d, alpha=alpha, out=_room(p_b, work))
    if not _is_one(s):  # p_b is the loop's own tensor (every view stores at least one d)
        p_b.div_(s.to(p_b.dtype) if isinstance(s, Tensor) else s)
    if extremes is not None:  # w = 1: exactly the constant; w = 0: p_b itself (1·p_b + 0)
        w = (extremes[0] == extremes[1]).to(p_b.dtype)  # 13.7 µs a 64K-element part; lerp_ took 25.9
        p_b.mul_(1 - w).add_(extremes[0].to(p_b.dtype) * w)
    u = torch.sub(real(after), p_b, out=p_b)
    u = torch.view_as_complex(u) if after.is_complex() else u
    return u, (_total([d for d, _ in adds]) if meant and _is_one(s) else None)


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
    ``truth``. Per element, miss is the larger of the figure's error |u - truth| and the view's
    error beyond what the store's rounding explains, max(|meant - truth| - r, 0) with
    r = eps·(|p_after| + |p_before|) / 2 (half a spacing of each value; ``meant`` None: no view)."""
    err = (u.to(truth.dtype) - truth).abs()
    if meant is not None:
        after = p.detach().to(truth.dtype)
        r = eps(p.dtype) * (after.abs() + (after - truth).abs()) / 2
        err = torch.maximum(err, ((meant.to(truth.dtype) - truth).abs() - r).clamp_(min=0))
    return torch.stack([torch.linalg.vector_norm(err), torch.linalg.vector_norm(truth)]).double()


@functools.lru_cache(maxsize=None)
def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating or complex dtype (of its real part)."""
    return torch.finfo(dtype.to_real() if dtype.is_complex else dtype).eps


def _is_one(s: float | Tensor) -> bool:
    return not isinstance(s, Tensor) and s == 1.0


def storage_key(p: Tensor) -> int | None:
    """The address of ``p``'s storage (its data pointer less its offset), None for a tensor with none
    to share: sparse, without memory (meta), or empty (an empty view shares no element)."""
    if p.layout is not torch.strided or p.numel() == 0:
        return None
    try:
        address = p.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass whose storage is not its own (DTensor): its data pointer
        address = p.data_ptr()  # (0 for a DTensor) says whether it has one
        address = address and address - p.storage_offset() * p.element_size()
    return address or None


def shared(params: Iterable[Tensor]) -> set[int]:
    """The ids of those of ``params`` whose storage (:func:`storage_key`) is used more than once among
    them (a tensor listed twice, views of one buffer): the optimizer's updates land in the same memory."""
    params = list(params)
    keys = [storage_key(p) for p in params]
    count = Counter(keys)
    if len(count) == len(keys):  # all apart (the usual case)
        return set()
    return {id(p) for p, key in zip(params, keys) if key is not None and count[key] > 1}

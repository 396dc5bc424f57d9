"""The snapshot and centring rules: which parameters get an exact copy of p_before, and their memories.

The truth of every figure is the change of the *stored* parameter, u = p_after - p_before. A
state-aware view gives the update the optimizer computed; the stored value differs from
p_before + that update by the rounding of the store, and that rounding does not average out where
values are constant (every element of a LayerNorm gain at 1.0 rounds the same way) or where the
update is a few units in the last place (warmup learning rates, bf16). So an exact copy of
p_before is taken, on logging steps only (:func:`snapshot_reason`), for a parameter that

* is a *vector* (ndim < 2: biases, norm gains, scalars, where constant initialisation lives and
  which hold about 0.1% of a transformer's bytes);
* is *bf16 or fp16* (the store's spacing, 2^-8 relative for bf16, makes power-of-two crossings
  common, and there the rounding cannot be inverted: two p_before map to one p_after), or complex;
* *shares its storage* with another monitored parameter;
* is a float32/float64 matrix whose values sit so close to a power of two that crossings would
  matter (near-constant ones; a block at 1.0): as the last logging steps measured
  (:func:`rounding_risk`, :func:`at_powers_of_two`; :class:`RiskMemory` keeps the verdict for
  :data:`SNAPSHOT_FOR` logging steps), or, before the first, as found when the optimizer is built
  (:func:`risky_when_built`).

The other matrices' stored change comes from the view's update by inverting the store's rounding
(:mod:`monitored_optim.capture.change`). Source of the rounding facts: IEEE 754 round-to-nearest;
the docs' "update formulas" page, section on the store.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..stats import KINDS, LOW_PRECISION, MISS
from .bits import BITS

if TYPE_CHECKING:
    from ..hosted import MomentTable
    from ..workspace import Workspace

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

    A store's spacing is about ``eps·|p|``, and an element can be recovered wrongly by up to one spacing
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


ALIGNED_ABOVE = MISS
""":func:`rounding_risk`'s first-order bound (elements exactly at a power of two) above which a matrix
is snapshotted (:data:`~monitored_optim.stats.MISS`)."""


HALF_ULP = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
"""Per dtype, half the spacing of its values just above 1.0: 2^-(mantissa width + 1)."""


def mantissa_gap(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``fl(x + x·h) - x`` with h = :data:`HALF_ULP` of x's dtype, elementwise: 0 where x has no
    mantissa bits (±2^k, and 0), nonzero where it has some and ``|x| >= 2^-102`` (float32; 2^-969 for
    float64), NaN at ±inf and NaN.

    There x·h is exact (a power-of-two scaling) and half a spacing of x or more: at ±2^k exactly
    half, a tie that rounds to x's even neighbour, x itself; above 2^k more than half, which rounds
    to the next value. Below that x·h rounds (or underflows), and the gap can be 0 for any value,
    always for subnormals: harmless for the sums of squares this test serves, which are 0 there.
    Only element-wise float ops, so that inductor fuses the test into the pass that reads x for its
    sums (:func:`~monitored_optim.capture.fused.prior`); compiled code must keep IEEE semantics
    (:data:`~monitored_optim.capture.compiler.INDUCTOR`: unsafe math turns this into x·h, never 0).

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
    """Σ p_after^2 over the elements at a power of two before or after the step, float64 ``(1,)``.

    There (no mantissa bits) an inversion of the store may miss (:func:`rounding_risk`).
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

    def update(self, names: list[str], position: dict[str, int], eps: Tensor, table: MomentTable,
               exact: Tensor) -> None:
        """After a logging step: renew the count of the parameters whose rounding risk was above the
        bounds, count down the others it holds that had elements.

        Args:
            names: the parameters' names, the rows of ``table``; ``position``: name -> row.
            eps: float64 ``(N,)``, :func:`eps` of each parameter's dtype.
            table: the step's :class:`~monitored_optim.hosted.MomentTable`.
            exact: float64 ``(N,)``, :func:`at_powers_of_two` where measured, NaN elsewhere.
        """
        std, n = table.std, table.n[:, 0]
        risky = rounding_risk(eps, table.sq_norm[:, 0] / n.clamp(min=1), std[:, 0], std[:, 2], table.sq_norm[:, 2],
                              exact)
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
    """Per parameter, whether the snapshot rule takes it from the first logging step on.

    True for a float32/float64 matrix, until logging steps measure its :func:`rounding_risk`, whose spread is below
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
    """An upper bound of :func:`at_powers_of_two` (p, p) in a few eager ops, for the eager inversion.

    It is the count of nonzero elements whose mantissa bits are all zero (±2^k, and ±inf, with which
    no figure of the part stays finite anyway) times the larger square of p's
    :func:`~monitored_optim.capture.change.bounds`, float64 of shape (1,). None for a dtype other than
    float32/float64, without bounds, or for a part larger than ``work``'s buffer (the whole matrices of
    views that are not element-wise: Adafactor's, Muon's), whose measure would hold a temporary of
    their size before the step.

    Args:
        p: a float32/float64 part before the step (any shape).
        extremes: its :func:`~monitored_optim.capture.change.bounds`, shape (2,).
        work: whose :meth:`~monitored_optim.workspace.Workspace.one` buffer holds the temporary
            (reused, so that the heap does not fragment), or None (a temporary of its own).
    """
    too_large = work is not None and p.numel() * p.element_size() > work.nbytes
    if p.dtype not in HALF_ULP or extremes is None or too_large:
        return None
    x = p.detach()
    kind, _, exponent = BITS[x.dtype]  # past the sign and the exponent, only the mantissa bits are left
    out = None if work is None else work.one(x).view(kind)
    mantissa = torch.bitwise_left_shift(x.view(kind), 1 + exponent, out=out)
    exact = torch.count_nonzero(x) - torch.count_nonzero(mantissa)  # zeros have no mantissa bits either
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


@functools.lru_cache(maxsize=None)
def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating or complex dtype (of its real part)."""
    return torch.finfo(dtype.to_real() if dtype.is_complex else dtype).eps


def storage_key(p: Tensor) -> int | None:
    """The address of ``p``'s storage (its data pointer less its offset), None for a tensor with none
    to share: sparse, without memory (meta), or empty (an empty view shares no element)."""
    if p.layout is not torch.strided or p.numel() == 0:
        return None
    try:
        address = p.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass whose storage is not its own (DTensor): its data pointer
        address = p.data_ptr()  # (0 for a DTensor) says whether it has one
        address = address and address - int(p.storage_offset()) * p.element_size()
    return address or None


def shared(params: Iterable[Tensor]) -> set[int]:
    """The ids of those of ``params`` whose storage another of them uses too (:func:`storage_key`).

    A tensor listed twice, or views of one buffer: the optimizer's updates land in the same memory."""
    params = list(params)
    keys = [storage_key(p) for p in params]
    count = Counter(keys)
    if len(count) == len(keys):  # all apart (the usual case)
        return set()
    return {id(p) for p, key in zip(params, keys) if key is not None and count[key] > 1}


class CentringMemory:
    """The centring rule's memory: which moments of each parameter take the centred pass at its next
    eager capture.

    A parameter not measured before takes it for every kind of :data:`~monitored_optim.stats.KINDS`.
    After a logging step, :meth:`update` keeps
    :attr:`~monitored_optim.hosted.MomentTable.needs_centring` of the parameters the eager capture
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
        kept = self._flags
        kept.update({names[i]: flag if grad else [flag[0], kept.get(names[i], self.FIRST)[1], flag[2]]
                     for i, flag, grad, size in zip(rows, flags, grads, sizes) if size})

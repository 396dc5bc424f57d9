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
  there the rounding cannot be inverted: two p_before map to one p_after), *shares its storage*
  with another monitored parameter, or is a float32/float64 matrix whose last logging step found
  its values so close to constant that crossings would matter (:func:`rounding_risk`).
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

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .updates import Decayed, Scaled

LOW_PRECISION = (torch.float16, torch.bfloat16)

PART_ELEMENTS = 1 << 18
"""Largest slice (elements) of a parameter rebuilt and reduced at once: 1 MiB of float32, so a
logging step's temporaries stay a few MiB whatever the model's size."""

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
        risky: :func:`rounding_risk` of the last logging step was above :data:`RISK_ABOVE`.

    Returns:
        ``"aliased"``, ``"vector"``, ``"low precision"``, ``"near-constant"`` or None.
    """
    if aliased:
        return "aliased"
    if p.dim() < 2:
        return "vector"
    if p.dtype in LOW_PRECISION:
        return "low precision"
    return "near-constant" if risky else None


def rounding_risk(eps: Tensor, mean_sq_p: Tensor, std_p: Tensor, std_u: Tensor) -> Tensor:
    """How much an inverted rounding may miss: eps^2 · E[p^2] / (std(u) · std(p)), per parameter.

    A store's spacing is about eps·|p|. An element can be recovered wrongly only where the step
    crossed a power of two upwards (the spacing doubles there), which a fraction of about
    std(u) / std(p) of the elements do, each off by up to eps·|p| on an update of size std(u):
    their share of ||u||^2 is about (eps·|p|)^2 / (std(u)·std(p)). Above :data:`RISK_ABOVE` (a
    matrix of near-constant values near a power of two) the next logging step snapshots instead.
    No update (std(u) zero or undefined) is no risk: every element's update was below half a
    spacing, and the inversion gives exactly zero there; constant weights that moved are.

    Args:
        eps, mean_sq_p, std_p, std_u: float64 tensors of one shape: each parameter's :func:`eps`,
            E[p^2], std(p) and std(u) from the last logging step.

    Returns:
        Bool tensor of that shape.
    """
    moved = std_u.nan_to_num(nan=0.0) > 0
    risk = (eps * eps * mean_sq_p / (std_u * std_p)).nan_to_num(nan=0.0, posinf=1.0)
    return moved & (risk > RISK_ABOVE)


@dataclass
class Part:
    """One flat slice ``span`` of the parameter ``whole``, as a view to hand to an update view: ``p``
    (a detached view whose ``.grad`` is the matching slice of the grad) and ``state`` (each tensor
    shaped like the parameter sliced the same way; scalars and other tensors as they are). A whole
    parameter is its own single part (``span`` None, ``p`` the parameter itself)."""

    p: Tensor
    state: dict[str, Any]
    whole: Tensor
    span: slice | None = None

    def refresh(self, state: dict[str, Any]) -> dict[str, Any]:
        """After the step: point ``p.grad`` at the slice of the parameter's grad now (a closure may
        have made a new one) and return the slice of the post-step ``state`` (created lazily by the
        first step)."""
        if self.span is None:
            return state
        grad = self.whole.grad
        self.p.grad = None if grad is None else grad.view(-1)[self.span]
        self.state = _slice_state(state, self.whole, self.span)
        return self.state


def parts(p: Tensor, state: dict[str, Any], elementwise: bool) -> list[Part]:
    """``p`` cut into flat slices of at most :data:`PART_ELEMENTS` elements, or ``[Part(p, state, p)]``.

    Only where the update of a slice depends on nothing but the same slice of p, its grad and its
    state (``elementwise``: the element-wise views), and p, its grad and those state tensors are
    contiguous and dense.
    """
    n = p.numel()
    grad = p.grad
    shaped = [v for v in state.values() if isinstance(v, Tensor) and v.shape == p.shape]
    if (not elementwise or n <= PART_ELEMENTS or not p.is_contiguous()
            or (grad is not None and (grad.is_sparse or not grad.is_contiguous()))
            or not all(v.is_contiguous() and not v.is_sparse for v in shaped)):
        return [Part(p, state, p)]
    out = []
    for start in range(0, n, PART_ELEMENTS):
        span = slice(start, min(n, start + PART_ELEMENTS))
        piece = p.detach().view(-1)[span]
        piece.grad = None if grad is None else grad.view(-1)[span]
        out.append(Part(piece, _slice_state(state, p, span), p, span))
    return out


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


def _slice_state(state: dict[str, Any], p: Tensor, span: slice) -> dict[str, Any]:
    return {k: (v.reshape(-1)[span] if isinstance(v, Tensor) and v.shape == p.shape else v)
            for k, v in state.items()}


def dense(intended: Tensor | Scaled | Decayed) -> tuple[Tensor, float | Tensor]:
    """``(d, s)`` of an update view's result: p_after = fl(fl(s·p_before) + d), d as a new or the
    view's own tensor."""
    s: float | Tensor = 1.0
    if isinstance(intended, Decayed):
        intended, s = intended.d, intended.s
    d = intended.dense() if isinstance(intended, Scaled) else intended
    return (d.to_dense() if d.is_sparse else d), s


def bounds(p: Tensor) -> Tensor | None:
    """``[min, max]`` of a real part before the step (one reduction, no temporary): where they are
    equal the part was constant (a matrix initialised at 1.0 or 0) and p_before is that value
    exactly, which the inversion cannot tell from its neighbour where the step crosses a power of
    two. None for complex parts."""
    return None if p.is_complex() or p.numel() == 0 else torch.stack(torch.aminmax(p.detach()))


def stored_change(p: Tensor, intended: Tensor | Scaled | Decayed | None, before: Tensor | None,
                  extremes: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """The stored change u = p_after - p_before of one part, and the intended update it came from.

    Args:
        p: the part after the step (any floating or complex dtype).
        intended: the view's result (None: the step left ``p`` unchanged; a view's own clone
            fallback passes None with ``before``).
        before: the exact snapshot of p_before, or None to invert the rounding (float32/float64).
        extremes: :func:`bounds` of p_before, for the inversion.

    Returns:
        ``(u, intended_u)``: u as a new tensor (float32 for bf16/fp16 parameters; None where nothing
        moved and there is no snapshot), and the update the optimizer meant, d + (s - 1)·p_before
        (None when ``intended`` is None), which :func:`lost` compares with u.
    """
    after = p.detach()
    if before is not None:
        wide = torch.float32 if after.dtype in LOW_PRECISION else after.dtype
        u = after.to(wide) - before.to(wide)
        if intended is None:
            return u, None
        d, s = dense(intended)
        meant = d.to(wide) if _is_one(s) else d.to(wide) + (s - 1) * before.to(wide)
        return u, meant
    if intended is None:
        return None, None
    d, s = dense(intended)
    d = d.to(after.dtype)
    p_b = after - d  # one rounding in p's dtype: the nearest value to p_after - d
    if not _is_one(s):
        p_b.div_(s.to(after.dtype) if isinstance(s, Tensor) else s)
    if extremes is not None:  # weight 1 gives exactly the constant, weight 0 p_b itself
        p_b.lerp_(extremes[0].to(p_b.dtype), (extremes[0] == extremes[1]).to(p_b.dtype))
    return torch.sub(after, p_b, out=p_b), d


def lost(u: Tensor, meant: Tensor | None, grad: Tensor | None) -> Tensor:
    """Elements the optimizer meant to move whose stored value did not change: a float64 count of
    shape (1,). Without the intended update (no state-aware view), elements with a non-zero grad."""
    if meant is None:
        if grad is None:
            return u.new_zeros(1, dtype=torch.float64)
        meant = grad.to_dense() if grad.is_sparse else grad
    return ((u == 0) & (meant != 0)).sum().double().reshape(1)


def verify_miss(u: Tensor, truth: Tensor, estimate: Tensor, p: Tensor, before: Tensor) -> Tensor:
    """Verify mode: ``[||excess||, ||truth||]`` (float64, shape (2,)) of a part, where excess is the
    estimate's error beyond what the store's rounding explains: max(|estimate - truth| - r, 0)
    with r = eps·(|p_after| + |p_before|) / 2 for a view's intended update next to a snapshot (the
    store rounds it), and r = 0 for an inverted update (it must be the stored change itself)."""
    err = (estimate.to(truth.dtype) - truth).abs()
    if estimate is not u:
        err = (err - eps(p.dtype) * (p.detach().to(truth.dtype).abs() + before.to(truth.dtype).abs()) / 2).clamp_(min=0)
    return torch.stack([torch.linalg.vector_norm(err), torch.linalg.vector_norm(truth)]).double()


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating or complex dtype (of its real part)."""
    return torch.finfo(dtype.to_real() if dtype.is_complex else dtype).eps


def _is_one(s: float | Tensor) -> bool:
    return not isinstance(s, Tensor) and s == 1.0


def storages(params: Iterator[Tensor]) -> dict[int, int]:
    """How many of ``params`` use each storage (keyed by its data pointer; meta and sparse skipped)."""
    count: dict[int, int] = {}
    for p in params:
        if p.is_sparse or p.device.type == "meta":
            continue
        key = p.untyped_storage().data_ptr()
        count[key] = count.get(key, 0) + 1
    return count

"""The clone-and-diff fallback: exact for any optimizer, at the cost of one copy of the parameter."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .view import View


@dataclass(frozen=True)
class Cloned:
    """A snapshot holding a detached copy of ``p`` taken before the step (in host memory, see :meth:`of`)."""

    before: Tensor

    @classmethod
    def of(cls, p: Tensor) -> Cloned:
        """The snapshot of ``p`` before the step: a copy on its device, or in host memory where
        ``p``'s device type is in ``STAGED`` (copied asynchronously into pinned memory on CUDA),
        so that a logging step holds no copy of the model on the device."""
        x = p.detach()
        if x.device.type not in STAGED:
            return cls(x.clone())
        host = torch.empty_like(x, device="cpu", pin_memory=x.is_cuda)
        return cls(host.copy_(x, non_blocking=x.is_cuda))

    def update(self, p: Tensor) -> Tensor:
        """``p_after - p_before``, computed in float32 for bf16/fp16 parameters (exact there)."""
        after = p.detach()
        before = fetched(self.before, after)
        if after.dtype.itemsize < 4 and after.is_floating_point():
            return after.float() - before.float()
        return after - before


STAGED: frozenset[str] = frozenset({"cuda"})
"""Device types whose snapshots (:meth:`Cloned.of`) are kept in host memory and brought back to the
device a part at a time after the step (:func:`fetched`)."""


def fetched(before: Tensor, like: Tensor) -> Tensor:
    """``before`` on ``like``'s device: itself where it is there already, else a copy (one part)."""
    return before if before.device == like.device else before.to(like.device, non_blocking=True)


@dataclass(frozen=True)
class Scaled:
    """An update ``factor * tensor`` a view returns without forming it (SGD: u = -lr * buf).

    The monitor reduces ``tensor`` and scales the sums, which saves a parameter-sized temporary
    and a pass; :meth:`dense` forms u where it is needed elementwise (bf16, verify mode).
    """

    tensor: Tensor
    factor: float | Tensor

    def dense(self, out: Tensor | None = None) -> Tensor:
        """``tensor * factor``, as a new tensor or into ``out`` (one ``mul`` either way)."""
        return torch.mul(self.tensor, self.factor, out=out)


@dataclass(frozen=True)
class Stores:
    """An update applied in several stores: p ← fl(s·p) (decoupled weight decay, s = 1 - lr·λ, a
    float or a 0-dim Tensor; none where s is 1), then p ← fl(p + d) for each d of ``adds`` in order
    (tensors or :class:`Scaled`; NAdam adds its gradient and its momentum terms one after the other).

    A view returns this instead of solving for p_before itself, so that the capture can invert
    every rounding in turn (:mod:`monitored_optim.capture.change`).
    """

    adds: tuple[Tensor | Scaled, ...]
    s: float | Tensor = 1.0


@dataclass(frozen=True)
class Rows:
    """An update delivered a slice at a time, for a large parameter whose update is not element-wise
    but can be rebuilt in consecutive rows (Adafactor's factored second moment): ``slices()``
    yields ``(span, result)`` pairs, ``result`` (a tensor, :class:`Scaled` or :class:`Stores`)
    being the update of ``p.view(-1)[span]``, built only when the capture asks for it."""

    slices: Callable[[], Iterator[tuple[slice, Any]]]


@dataclass(frozen=True)
class Summed:
    """An update known by the sums of its stored change alone: taken before the step by replaying
    it (``replayed``: a view whose rebuild cannot recover p_before, schedule-free's lerp towards z),
    or during the step, as the optimizer steps the parameter in its turn (:mod:`~monitored_optim.updates.turns`).

    ``row`` is float64 of shape (3,) on p's device, ``(c, Σ(u - c), sqrt(Σ(u - c)²))`` for a shift c
    (the form of :meth:`monitored_optim.stats.Batch.put`), over the ``n`` elements of the part. The
    capture adds it to the part's sums instead of reducing a tensor; where it needs u element by
    element (a family's ``part`` hook) the view's snapshot is a clone instead.
    """

    row: Tensor
    n: int
    replayed: bool = True


class CloneView(View):
    """u = p_after - p_before from a clone taken on logging steps only. Used for optimizers without
    a state-aware view (LBFGS moves p several times per step, third-party optimizers, user
    subclasses that override ``step``). Extra memory: one copy of every monitored parameter."""

    elementwise = True

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> Cloned:
        return Cloned.of(p)

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Cloned) -> Tensor:
        return snapshot.update(p)


CLONE = CloneView()
"""The shared clone view."""

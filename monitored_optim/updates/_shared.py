"""Small helpers shared by the state-aware views.

Each is a pure function of the optimizer's own objects; none keeps state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _default_to_fused_or_foreach

KAPPA_MAX = 2.0
"""Largest condition number κ = D / |D - k| that a weight-decay solve ``u = -(…)/(D - k)`` accepts.

The rebuilt u then differs from the update torch applied by at most κ·ulp(p) per element (the
rounding of p_after, amplified), the same order as the clone-based truth's own rounding."""


CHECK_BLOCK = 1 << 16
"""Elements per block of a view's exactness check before the step (:func:`blocks`)."""


def blocks(*xs: Tensor | None) -> Iterator[tuple[Tensor | None, ...]]:
    """The flat blocks of :data:`CHECK_BLOCK` elements of ``xs`` (of one size), in step; None stays None.

    A check before the step replays it a block at a time: its temporaries are then a few small
    buffers that the allocator reuses, where a part's worth of them, interleaved with the entries
    the capture keeps, would leave host memory fragmented.
    """
    flat = [None if x is None else x.reshape(-1) for x in xs]
    n = next(f.numel() for f in flat if f is not None)
    for start in range(0, n, CHECK_BLOCK):
        yield tuple(None if f is None else f[start:start + CHECK_BLOCK] for f in flat)


def ran_foreach(group: dict[str, Any]) -> bool:
    """Whether torch took the ``_multi_tensor_*`` path for this group: the decision the functional
    API makes (``foreach`` as given, else ``_default_to_fused_or_foreach`` over the params with a
    grad, only when neither ``foreach`` nor ``fused`` is given; always False on CPU)."""
    foreach = group.get("foreach")
    if foreach is None and group.get("fused") is None:
        with_grad = [q for q in group["params"] if q.grad is not None]
        _, foreach = _default_to_fused_or_foreach(with_grad, group.get("differentiable", False), use_fused=False)
    return bool(foreach) and not torch.jit.is_scripting()


def real(t: Tensor) -> Tensor:
    """``t`` as torch steps it: a complex tensor as its (…, 2) real view, a real one unchanged."""
    return torch.view_as_real(t) if torch.is_complex(t) else t


def like(u: Tensor, p: Tensor) -> Tensor:
    """Undo :func:`real` on a rebuilt update, so that it has ``p``'s dtype and shape."""
    return torch.view_as_complex(u) if torch.is_complex(p) else u


def to_scalar(x: float | Tensor) -> float | Tensor:
    """torch's ``_to_scalar``: a 1-element Tensor hyperparameter as a 0-dim tensor, a number as is."""
    return x.squeeze() if isinstance(x, Tensor) and x.dim() != 0 else x


def in_double(x: float | Tensor) -> float | Tensor:
    """A scalar for products torch never forms (e.g. lr·λ in a solve): a Tensor as float64, exact."""
    return x.double() if isinstance(x, Tensor) else x


def max_kappa(denom: Tensor, k: float | Tensor) -> float:
    """max over elements of |D| / |D - k| (host read: call only for CPU tensors)."""
    return (denom.abs() / (denom - k).abs()).amax().item()


def decay_solvable(group: dict[str, Any]) -> bool:
    """Whether dividing by the decoupled-decay factor s = 1 - lr·λ is well conditioned (1/|s| <= KAPPA_MAX).

    s is a constant per group, so this is decided before the step; lr·λ near 1 (a huge weight
    decay) sends the parameter to a clone instead. A Tensor lr is read on the host only when
    λ >= 0.1, so that the usual small decays cost no host read per parameter.
    """
    lr, wd = group["lr"], float(group.get("weight_decay", 0.0))
    if isinstance(lr, Tensor) and wd < 0.1:
        return True  # lr·λ < 1/2 unless lr > 5: not a learning rate anyone steps with
    s = 1.0 - float(lr) * wd
    return abs(s) * KAPPA_MAX >= 1.0

"""Pieces: the per-parameter device values of a logging step, and how each one reduces.

Besides a parameter's moments, a logging step keeps a few float64 device tensors per parameter,
each under a key (``"lost"``, ``"verify"``, ``"state_norm:exp_avg"``, ...). A parameter may be
measured in parts (slices of a large tensor) and, under ``torch.distributed``, in shards on several
ranks; every key declares once, by its head (the key before any ``:``), how its values combine:

========  =========================================  ==============================================
reduce    value                                      over parts / over ranks (weights w, see
                                                     :mod:`monitored_optim.distributed`)
========  =========================================  ==============================================
MOMENTS   ``(mean, m2)`` of p, grad or u             merged by :class:`~monitored_optim.stats.Batch`
                                                     / as weighted power sums
SUM       counts or sums, shape ``(k,)``, k the      added / weighted sum, element by element
          key's declared width (1 unless declared)
NORM      L2 norms, shape ``(k,)``                   ``hypot`` / ``sqrt`` of the weighted sum of
                                                     squares
WHOLE     a value of the whole tensor, ``(1,)``      comes from one part / weighted sum over the
          (the spectral norm)                        replicas; undefined where ranks hold shards
MIN       a least value, ``(1,)``; +inf: none        the least / the least over the ranks whose
                                                     piece counts (weight > 0), replicas alike
MAX       a greatest value, ``(1,)``; -inf: none     the greatest / as MIN
========  =========================================  ==============================================

The monitor's own keys are :data:`CORE`; a figure family declares the keys it makes in its
``pieces`` attribute and the width of a SUM key of more than one value in ``widths``
(:class:`~monitored_optim.families.base.Family`; the ``histograms`` family's counts).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

MOMENTS, SUM, NORM, WHOLE, MIN, MAX = "moments", "sum", "norm", "whole", "min", "max"

CORE = {"p": MOMENTS, "grad": MOMENTS, "u": MOMENTS, "lost": SUM, "exact": SUM, "verify": NORM}
"""The monitor's own keys: the moments, the bf16/fp16 lost-update count, the sum of p² over
elements at a power of two (the rounding-risk rule's evidence), verify mode's pair of norms."""


def head(key: str) -> str:
    """The part of a key before any ``:`` (``state_norm:exp_avg`` -> ``state_norm``)."""
    return key.split(":", 1)[0]


class Keys(dict):
    """Every full key -> its reduction, in the order of the sharded table's rows (``"p"`` first), and
    each SUM key's width: how many values a parameter's piece holds (:meth:`width`).

    Attributes:
        heads: the head of every key (:func:`head`) -> its reduction.
    """

    def __init__(self, how: dict[str, str], widths: Mapping[str, int] | None = None) -> None:
        super().__init__(how)
        self.widths = dict(widths or {})
        self.heads = {head(key): reduction for key, reduction in how.items()}

    def width(self, key: str) -> int:
        """Values per parameter of ``key`` (1 unless declared; a NORM piece's two norms count as one)."""
        return self.widths.get(key, 1)


def keys(families: Iterable[object]) -> Keys:
    """Every full key -> reduction: :data:`CORE` then each family's ``pieces``, in that order, with the
    widths the families declare."""
    fams = list(families)
    return Keys({**CORE, **{key: how for fam in fams for key, how in getattr(fam, "pieces", {}).items()}},
                {key: n for fam in fams for key, n in getattr(fam, "widths", {}).items()})


def combine(how: str, kept: Tensor, value: Tensor) -> Tensor:
    """Two parts' values of one key, as one: NORM by ``hypot``, MIN and MAX the lesser and the
    greater, SUM (and the others) added."""
    if how == NORM:
        return torch.hypot(kept, value)
    if how in (MIN, MAX):
        return torch.minimum(kept, value) if how == MIN else torch.maximum(kept, value)
    return kept + value


def accumulate(pieces: dict[str, Tensor], key: str, value: Tensor, reductions: Mapping[str, str]) -> None:
    """Add a part's ``value`` of ``key`` into a parameter's ``pieces``, by its declared reduction."""
    kept = pieces.get(key)
    pieces[key] = value if kept is None else combine(reductions[head(key)], kept, value)

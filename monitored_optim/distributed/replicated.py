"""Replicated parameters: a plain tensor that every rank monitoring it holds whole (DDP, the
unplanned part of tensor parallelism, ZeRO wrapped as the monitored class, a pipeline stage's
parameters replicated over data parallelism)."""

from __future__ import annotations

from torch import Tensor

from .held import Held


def held(p: Tensor) -> Held:
    """``p`` itself, one replica among the ranks that monitor it."""
    return Held(p, p, shards=1)

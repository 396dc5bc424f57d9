"""torch's ``ZeroRedundancyOptimizer`` with a monitored inner optimizer (``optimizer_class=Monitored(…)``).

ZeRO gives each rank of its group of size G the parameters it owns; the inner optimizer of each
rank steps only those, but the monitor reads ZeRO's full list on every rank so that all ranks build
the same table: an owned parameter is one of G shards (weight G / holders), the others weigh 0.

Source: ``torch/distributed/optim/zero_redundancy_optimizer.py`` (partition and ``_local_step``).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .held import Held

_PARENT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def held(p: Tensor, zero: Any) -> Held:
    """``p`` as this rank holds it under ``zero``: owned (one of G shards) or not counted."""
    owned = zero._param_to_rank.get(p) == zero.rank
    return Held(p, p, shards=zero.world_size if owned else 0)


def parent(optimizer: torch.optim.Optimizer) -> Any:
    """The ``ZeroRedundancyOptimizer`` whose local (inner) optimizer is ``optimizer``, or ``None``.

    ZeRO builds its inner optimizer itself and keeps no reference the inner one could follow; its
    ``_local_step`` is on the call stack whenever it steps the inner optimizer, so the frame is found
    there once and remembered.
    """
    found = _PARENT.get(optimizer)
    if found is not None:
        return found
    zero_mod = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero_mod is None:
        return None
    code = zero_mod.ZeroRedundancyOptimizer._local_step.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            owner = frame.f_locals.get("self")
            if getattr(owner, "optim", None) is optimizer:
                _PARENT[optimizer] = owner
                return owner
        frame = frame.f_back
    return None

"""DTensor parameters (FSDP2 ``fully_shard``, tensor parallel): the local tensor of each rank.

A DTensor on a mesh is split into S distinct shards, S the product of the mesh sizes of the
dimensions whose placement is not ``Replicate`` (``Shard``, ``_StridedShard``, any other); the
ranks holding it have S shards between them. A ``Partial`` grad is redistributed to the parameter's
placements first (one more collective, only then: :func:`~.held.set_local_grad`).

Source: ``torch/distributed/tensor/placement_types.py``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .held import Held

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def held(p: DTensor) -> Held:
    """A plain alias of ``p``'s local tensor, one of its :func:`shards`."""
    count = shards(p)
    return Held(p.to_local().detach(), p, shards=count, split=count > 1)


def shards(p: DTensor) -> int:
    """Number of distinct shards of a DTensor: the product of the mesh sizes of its non-Replicate,
    non-Partial dimensions (``_StridedShard.is_shard()`` is False in torch 2.13, hence the negation)."""
    mesh = p.device_mesh
    return math.prod(mesh.size(d) for d, pl in enumerate(p.placements)
                     if not (pl.is_replicate() or pl.is_partial()))

"""FSDP1 (``FullyShardedDataParallel``): original-parameter views and flat parameters.

With ``use_orig_params=True`` the optimizer steps the original parameters, each a view of this
rank's part of its unit's flat shard; otherwise it steps the ``FlatParameter``, whose last shard
may end in padding, which is left out. The unit's sharding group has S distinct shards (1 for
``NO_SHARD``).

Source: ``torch/distributed/fsdp/_flat_param.py`` (views and padding).
"""

from __future__ import annotations

import gc
from typing import Any

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .held import Held

_UNITS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter (FlatParameter or one of its original-parameter views) -> its FSDP1 module."""
_NO_UNIT = object()


def held(p: Tensor) -> Held | None:
    """This rank's shard of ``p``, or None where ``p`` is no FSDP1 parameter."""
    if not getattr(p, "_fsdp_flattened", False):
        return None
    unit = _unit(p)
    if unit is None:
        return None
    count = _shards(unit)
    padded = getattr(p, "_shard_numel_padded", 0) if p is unit._handle.flat_param else 0
    if padded:
        valid = p.numel() - padded
        return Held(p.detach()[:valid], p, shards=count, span=(0, valid), split=count > 1)
    return Held(p, p, shards=count, split=count > 1)


def _unit(p: Tensor) -> Any:
    """The ``FullyShardedDataParallel`` unit whose flat parameter holds ``p``, or ``None``.

    FSDP1 marks its flat parameters and, with ``use_orig_params=True``, the original parameters with
    ``_fsdp_flattened``; nothing points back from them, so the units are found once by a garbage
    collector scan (done again only when a new marked parameter appears).
    """
    unit = _UNITS.get(p)
    if unit is None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        for obj in gc.get_objects():  # type(), not isinstance(): no __class__ lookups (deprecation proxies warn)
            if issubclass(type(obj), FullyShardedDataParallel) and getattr(obj, "_handle", None) is not None:
                flat = obj._handle.flat_param
                _UNITS[flat] = obj
                for q in (getattr(flat, "_params", None) or []) + (getattr(flat, "_shared_params", None) or []):
                    _UNITS[q] = obj
        unit = _UNITS.setdefault(p, _NO_UNIT)  # not found: remembered, no scan at every step
    return None if unit is _NO_UNIT else unit


def _shards(unit: Any) -> int:
    """Distinct shards of an FSDP1 unit's parameters: its sharding group's size, 1 for ``NO_SHARD``."""
    from torch.distributed.fsdp import ShardingStrategy

    if unit.sharding_strategy == ShardingStrategy.NO_SHARD:
        return 1
    return unit.process_group.size()

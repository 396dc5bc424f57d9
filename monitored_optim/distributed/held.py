"""What one rank holds of one parameter, as every layout module describes it.

A layout module (replicated, DTensor shards, FSDP1 flat parameters, torch's ZeRO, DeepSpeed flat
partitions) turns each parameter the optimizer steps into :class:`Held` records; the
:class:`~monitored_optim.distributed.Sharding` hands their ``local`` tensors to the capture, and
:mod:`~monitored_optim.distributed.table` weighs each one so that every element of every parameter
counts once over the world.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass(eq=False)
class Held:
    """This rank's shard of one parameter.

    Attributes:
        local: the plain tensor the capture reads (the parameter itself, a detached alias of a
            DTensor's local tensor, or a view into a flat buffer); its ``.grad`` is set by the
            :class:`~monitored_optim.distributed.Sharding`.
        param: the tensor the optimizer steps: its ``state`` key and where the grad comes from.
        shards: how many distinct shards of the parameter the ranks holding it have between them
            (1: each holds a replica; 0: this rank's shard does not count, as a ZeRO non-owner);
            ``None``: no other rank holds these elements. The weight of the shard is
            ``shards / holders`` (holders: the ranks that monitor the parameter), or 1 for ``None``.
        span: ``(start, numel)``, the elements of the flattened ``param`` that ``local`` is (a flat
            partition's fragment, an FSDP1 shard without its padding); ``None``: all of it.
        split: the parameter is cut across ranks here: figures of a whole tensor are left out and
            views that are not element-wise clone ``local``.
        source: the model's parameter that ``local`` belongs to, when ``param`` is another tensor
            (a flat buffer of several parameters): its name is the figures' name.
    """

    local: Tensor
    param: Tensor
    shards: int | None
    span: tuple[int, int] | None = None
    split: bool = False
    source: Tensor | None = None

    def weight(self, holders: int) -> float:
        """The weight of this shard in the sum over ranks (``holders``: ranks monitoring the parameter)."""
        return 1.0 if self.shards is None else self.shards / holders


def whole_shape(p: Tensor) -> torch.Size:
    """A model parameter's whole shape (DeepSpeed's ZeRO-3 keeps it in ``ds_shape`` while the tensor
    is empty, its elements partitioned across ranks)."""
    return getattr(p, "ds_shape", None) or p.shape


def is_dtensor(x: object) -> TypeGuard[DTensor]:
    """Whether ``x`` is a ``DTensor`` (without importing ``torch.distributed.tensor``)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(x, dtensor.DTensor)


def narrow(x: Tensor, span: tuple[int, int], like: Tensor) -> Tensor:
    """The elements ``span`` = ``(start, numel)`` of the flattened ``x``, shaped like ``like``
    (a view where ``x`` is contiguous)."""
    start, numel = span
    return x.reshape(-1)[start:start + numel].view(like.shape)


def set_local_grad(held: Held) -> None:
    """``held.local.grad`` = the part of ``held.param.grad`` matching ``local`` (``None`` without a grad).

    A DTensor grad laid out unlike its parameter (a ``Partial`` sum) is redistributed to the
    parameter's placements first: one collective, only then.

    Raises:
        RuntimeError: the local grad's shape differs from the local tensor's.
    """
    p, local = held.param, held.local
    g = p.grad
    if g is None:
        local.grad = None
        return
    if is_dtensor(g):
        assert is_dtensor(p)  # the grad of a DTensor parameter, itself one
        if tuple(g.placements) != tuple(p.placements) or g.device_mesh != p.device_mesh:
            g = g.redistribute(p.device_mesh, _no_partial(p.placements))  # a collective: rare
        g = g.to_local()
        g = g.wait() if hasattr(g, "wait") else g
    g = g.detach() if held.span is None else narrow(g.detach(), held.span, local)
    if g.shape != local.shape:
        raise RuntimeError(f"monitored_optim: the local grad of a sharded parameter has shape "
                           f"{tuple(g.shape)}, its local shard {tuple(local.shape)}")
    local.grad = g


def _no_partial(placements: tuple[Any, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate

    return [Replicate() if pl.is_partial() else pl for pl in placements]

"""``Workspace``: the reused buffers of a logging step's part-sized temporaries."""

from __future__ import annotations

import torch
from torch import Tensor

PART_ELEMENTS = 1 << 18
"""Elements taken at once, 1 MiB of float32, so that a logging step's temporaries stay a few MiB
whatever the model's size: the largest part of a parameter the capture rebuilds and reduces at once,
and the slice of a large tensor that :func:`~monitored_optim.stats._centred` centres (or the
histograms widen) at once."""


class Workspace:
    """The buffers of a logging step's part-sized temporaries, reused from part to part.

    A temporary of about 1 MiB that is freed and asked for again between small allocations that
    outlive it (each part's views, its rows of sums) is served by glibc from its heap once the
    first one freed has raised the dynamic mmap threshold, and the small allocations split its
    hole, so that the next temporary does not fit there and the heap grows. Two buffers per dtype
    and device, of ``nbytes`` each (the chunk budget,
    :func:`~monitored_optim.capture.change.budget`), made at first use and freed with the logging
    step, serve them: :meth:`one` (a temporary dead before the next is asked for) and :meth:`next`
    (the stored changes of a chunk, alive together until :meth:`reset`). A request that does not
    fit gets a tensor of its own.
    """

    def __init__(self, nbytes: int = PART_ELEMENTS * 4) -> None:
        self.nbytes = nbytes
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}
        self._used = 0

    def one(self, like: Tensor) -> Tensor:
        """A contiguous tensor of ``like``'s shape, dtype and device, valid until the next :meth:`one`."""
        return self._take("one", like, 0)

    def next(self, like: Tensor) -> Tensor:
        """A contiguous tensor of ``like``'s shape, dtype and device, valid until :meth:`reset`."""
        out = self._take("next", like, self._used)
        self._used += like.numel() if out._base is not None else 0  # a slice of the buffer
        return out

    def reset(self) -> None:
        """Hand :meth:`next`'s buffer out again from its start."""
        self._used = 0

    def named(self, name: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A contiguous tensor of ``like``'s shape and device (in ``dtype``, default ``like``'s), valid until
        the next :meth:`named` of the same ``name`` and dtype (a pass's own temporaries: the histograms')."""
        return self._take(name, like, 0, dtype or like.dtype)

    def _take(self, kind: str, like: Tensor, start: int, dtype: torch.dtype | None = None) -> Tensor:
        dtype = dtype or like.dtype
        key, n = (kind, dtype, like.device), like.numel()
        buf = self._buffers.get(key)
        if buf is None:
            size = dtype.itemsize
            buf = self._buffers[key] = torch.empty(max(n, self.nbytes // size), dtype=dtype, device=like.device)
        if start + n > buf.numel():
            return torch.empty(like.shape, dtype=dtype, device=like.device)
        return buf[start:start + n].view(like.shape)


def room(like: Tensor, work: Workspace | None) -> Tensor:
    """A new tensor like ``like`` (contiguous), or ``work``'s :meth:`Workspace.next`."""
    return torch.empty_like(like, memory_format=torch.contiguous_format) if work is None else work.next(like)

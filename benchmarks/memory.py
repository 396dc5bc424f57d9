"""Peak bytes of the tensors that a block of code allocates, on any device, without a profiler.

A ``TorchDispatchMode`` sees every aten op: each output that does not alias an input's storage
(views, in-place and ``out=`` results alias) is a new allocation of ``storage.nbytes()`` bytes,
freed when the last tensor holding it (outputs of later view ops included) is garbage collected.
``peak`` is the largest total alive at any moment. Tensors that existed before the block (weights,
grads, optimizer state) are not counted; new state that the block creates and keeps is.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory() as m: ...`` then ``m.peak`` (bytes, int) and ``m.live`` (bytes still held)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = t.untyped_storage().data_ptr()
            if key in self._refs:
                self._hold(t, key)
            elif key not in inputs and t.untyped_storage().nbytes() > 0:
                self._sizes[key] = t.untyped_storage().nbytes()
                self.live += self._sizes[key]
                self.peak = max(self.peak, self.live)
                self._hold(t, key)
        return out

    def _hold(self, t: torch.Tensor, key: int) -> None:
        self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)

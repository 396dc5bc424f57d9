"""``warn``: a warning attributed to the user's line (``opt.step()``), not to this package or torch;
``Once``: what a holder has warned about."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Hashable, Iterable
from types import FrameType
from typing import Any

import torch

_INSIDE = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
           os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` with the stack level of the first frame outside
    ``monitored_optim`` and ``torch`` (Python 3.12's ``skip_file_prefixes``, for 3.10 and 3.11)."""
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class Once:
    """The keys a holder has warned about, so that each is warned about once.

    A key is any hashable value: a parameter's name, a backend's, ``(kind, name)``, or None for a
    holder's one warning.
    """

    __slots__ = ("_told",)

    def __init__(self) -> None:
        self._told: set[Hashable] = set()

    def new(self, keys: Iterable[Hashable]) -> list[Any]:
        """Those of ``keys`` not warned about before, in their order without repeats; they count as
        warned about from now on."""
        fresh = [key for key in dict.fromkeys(keys) if key not in self._told]
        self._told.update(fresh)
        return fresh

    def first(self, key: Hashable = None) -> bool:
        """Whether ``key`` was not warned about before; it counts as warned about from now on."""
        return bool(self.new((key,)))

    def __len__(self) -> int:
        return len(self._told)

"""``warn``: a warning attributed to the user's line (``opt.step()``), not to this package or torch."""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

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

"""What a trainer's callback attaches with: the user's configuration, else the trainer's own logging.

The callbacks (:mod:`monitored_optim.hf`, :mod:`monitored_optim.lightning`) attach to the
optimizers a trainer built; with no :class:`~monitored_optim.config.MonitorConfig` given, the
figures go where the trainer's other figures go, every time the trainer logs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch

from .config import ENV_EVERY, MonitorConfig


def config_for(given: MonitorConfig | None, model: torch.nn.Module | None, backends: Sequence[Any],
               logdir: str | os.PathLike[str] | None, every: Any, prefix: str | None = None) -> MonitorConfig:
    """The configuration a callback attaches with.

    Args:
        given: the callback's configuration; each field it sets wins, the trainer's fill those it
            leaves unset (``backend``, ``logdir``, ``every``, ``model``), and ``prefix`` is joined
            after its own with ``.``.
        model: the trainer's model, which names the parameters.
        backends: the backends the trainer logs to, names or backend objects (none: the environment's,
            else the default).
        logdir: the trainer's log directory (None: the environment's, else the default).
        every: the trainer's logging period in optimizer steps; used where it is an int >= 1 and
            ``MONITORED_OPTIM_EVERY`` is not set.
        prefix: the tag prefix that keeps one of several optimizers apart, or None.
    """
    given = given if given is not None else MonitorConfig()
    period = every if isinstance(every, int) and every >= 1 and ENV_EVERY not in os.environ else None
    own: dict[str, Any] = {"backend": list(backends) or None, "logdir": logdir, "every": period, "model": model}
    unset = {field: value for field, value in own.items() if getattr(given, field) is None}
    return dataclasses.replace(given, **unset, prefix=".".join(p for p in (given.prefix, prefix) if p) or None)


def prefixes(optimizers: Sequence[Any]) -> list[str | None]:
    """One tag prefix per optimizer where there are several (its class name, ``-1``, ``-2``, ... after
    the first of a name, as Lightning's ``LearningRateMonitor`` names them), else ``[None]``."""
    if len(optimizers) < 2:
        return [None] * len(optimizers)
    seen: dict[str, int] = {}
    out: list[str | None] = []
    for opt in optimizers:
        name = type(getattr(opt, "_optimizer", opt)).__name__.removeprefix("Monitored")
        count = seen[name] = seen.get(name, -1) + 1
        out.append(name if count == 0 else f"{name}-{count}")
    return out

"""Whether monitored optimizers were stepped: a notice for one that a trainer left aside.

The HF Trainer with ``deepspeed=`` builds an optimizer of its own in place of ``optimizers=(opt,
None)``; the monitored one is then never stepped and nothing is logged, silently. Each monitor's
:class:`Usage` outlives it, so that :func:`tell_unstepped` can say so at ``close()`` or exit.
"""

from __future__ import annotations

import atexit
import sys

from ._warnings import warn


class Usage:
    """Whether a monitor's optimizer was ever stepped (kept past the monitor, for the exit's notice)."""

    __slots__ = ("label", "built", "stepped", "told")

    def __init__(self, label: str) -> None:
        self.label, self.built, self.stepped, self.told = label, False, False, False
        EVERY.append(self)


EVERY: list[Usage] = []
"""The usages of every monitor of this process, alive or not (told about at exit if never stepped)."""
ANY = Usage("any")
"""Whether any monitored optimizer of this process was stepped."""


TRAINERS = ("transformers", "deepspeed", "lightning", "accelerate")
"""Packages whose trainers may build an optimizer of their own in place of the one they were given."""


def tell_unstepped(usages: list[Usage]) -> None:
    """Warn once that monitored optimizers were built but never stepped, where no monitored optimizer
    of this process was and a trainer is loaded (one that built its own optimizer: nothing would be
    logged, silently), with the advice that fits the trainer loaded."""
    idle = [u for u in usages if u.built and not (u.stepped or u.told)]
    if not idle or ANY.stepped or not any(name in sys.modules for name in TRAINERS):
        return
    for u in idle:
        u.told = True
    warn(f"monitored_optim: {len(idle)} monitored optimizer(s) ({', '.join(sorted({u.label for u in idle}))}) were "
         f"built but never stepped, so nothing was logged; {advice()}", RuntimeWarning)


@atexit.register
def _tell_at_exit() -> None:
    tell_unstepped(EVERY)


def advice() -> str:
    """What to do instead, for the trainers loaded in this process (each one's where several are)."""
    told = []
    if "lightning" in sys.modules or "pytorch_lightning" in sys.modules:
        told.append("with Lightning, pass Trainer(callbacks=[MonitorCallback()]) (from monitored_optim.lightning "
                    "import MonitorCallback) to monitor the optimizers the Trainer steps")
    if "transformers" in sys.modules:
        told.append("with the HF Trainer, which builds an optimizer of its own under deepspeed=, pass "
                    "callbacks=[MonitorCallback()] (from monitored_optim.hf import MonitorCallback) to monitor the "
                    "one it steps")
    if "deepspeed" in sys.modules and not told:
        told.append("DeepSpeed builds an optimizer of its own from a config with an \"optimizer\" section: call "
                    "monitored_optim.attach(engine) after deepspeed.initialize to monitor the one it steps")
    return "; ".join(told) or "call monitored_optim.attach(optimizer) on the optimizer the trainer steps"

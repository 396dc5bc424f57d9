"""When and how the fused capture's passes are compiled: :func:`enabled` per device, and the
:class:`Fuser` that compiles each pass once (inductor options :data:`INDUCTOR`) and falls back to
eager where compiling fails."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._warnings import warn

RECOMPILES = 64
"""Graphs kept per fused function (one per chunk signature: count, ranks, kind, rebuild); Dynamo's
default of 8 would send a model with many signatures (conv nets) back to eager."""


def enabled(mode: str, device: torch.device) -> bool:
    """Whether the fused path runs for parameters on ``device`` under ``MonitorConfig(compile=mode)``.

    ``auto`` fuses on CUDA only, where every small op of the eager capture is a kernel launch; on a
    CPU the first logging step's compile outweighs what it saves but over thousands of logging steps
    (:doc:`/performance`)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


INDUCTOR = {"realize_reads_threshold": 64, "realize_opcount_threshold": 1000, "realize_cpu_opcount_threshold": 1000,
            "cpp.enable_unsafe_math_opt_flag": False}
"""Inductor options of the fused passes: recompute each element's p_before and u in every sum that
reads it rather than keep parameter-sized buffers for them (the memory the fused capture exists to
save), and keep IEEE float semantics whatever the user's inductor settings (the inversion of the
store and :func:`~monitored_optim.capture.rules.mantissa_gap` rely on each rounding)."""


def _inductor_options() -> dict[str, Any]:
    """:data:`INDUCTOR`, less the options this torch's inductor does not know (torch 2.11 has no
    ``realize_cpu_opcount_threshold``; ``torch.compile`` refuses an unknown option)."""
    from torch._inductor import config

    known = config.get_config_copy()
    return {key: value for key, value in INDUCTOR.items() if key in known}


class Fuser:
    """The fused capture's functions of one monitor under ``MonitorConfig(compile=mode)``: compiled
    where :func:`enabled`, eager elsewhere, and back to eager where compiling fails (warned once;
    the same figures, at the eager speed)."""

    def __init__(self, mode: str = "auto") -> None:
        self.mode = mode
        self._compiled: dict[str, Callable[..., Tensor]] = {}
        self._failed = False

    def __call__(self, fn: Callable[..., Any], *args: Any, device: torch.device) -> Any:
        """``fn(*args)``, compiled (dynamic shapes) where :func:`enabled` for ``device``, else or after
        a failure eagerly."""
        if enabled(self.mode, device) and not self._failed:
            try:  # building the compiled function can fail too (an option this torch refuses)
                compiled = self._compiled.get(fn.__name__)
                if compiled is None:
                    compiled = self._compiled[fn.__name__] = torch.compile(fn, dynamic=True,
                                                                           options=_inductor_options())
                config = torch._dynamo.config  # set and put back by hand (config.patch is far slower)
                limit = config.recompile_limit
                config.recompile_limit = max(limit, RECOMPILES)
                try:
                    return compiled(*args)
                finally:
                    config.recompile_limit = limit
            except Exception as err:  # noqa: BLE001 - any compiler failure: run eagerly instead
                self._failed = True
                warn(f"monitored_optim: compiling the fused capture failed ({type(err).__name__}: "
                     f"{str(err).splitlines()[0] if str(err) else ''}); it runs eagerly from now on, with the same "
                     "figures; MonitorConfig(compile=False) or MONITORED_OPTIM_COMPILE=0 uses the eager capture",
                     RuntimeWarning)
        return fn(*args)

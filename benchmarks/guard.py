"""What the guard costs, side by side in one process on the benchmark's model.

    python benchmarks/guard.py [--rounds 8] [--device cpu]

AdamW on TinyLM (benchmarks/overhead.py: 75 tensors, 1.7 M parameters), backend none, the default
``every=10`` and the default capture of the device. Modes, run in interleaved rounds of ten
iterations each, so that drift of a shared machine hits all of them alike:

* ``plain``: the optimizer alone;
* ``monitored``: ``Monitored(AdamW)`` without the guard;
* ``guard nonfinite``: with ``MonitorConfig(guard="nonfinite")``: each step the inf-norm of every
  grad and one host read of the verdict;
* ``guard nonfinite,spikes``: also each grad's L2 norm judged by the spike rule on the host;
* ``guard + alerts + stop_on``: the second, with every alert and stop kind on (none fires).

Prints, per mode, the median over rounds of the mean ``opt.step()`` time and of the mean iteration
time (forward, backward, step), then the ratios the issue asks for: the iteration with the guard to
the monitored iteration without it (``nonfinite`` <= 1.03, ``nonfinite,spikes`` <= 1.05).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import TinyLM, tinylm_modes  # noqa: E402

from monitored_optim import Monitored, MonitorConfig  # noqa: E402

MODES = {"plain": None, "monitored": {}, "guard nonfinite": {"guard": "nonfinite"},
         "guard nonfinite,spikes": {"guard": "nonfinite,spikes"},
         "guard + alerts + stop_on": {"guard": "nonfinite,spikes", "alerts": "all", "stop_on": "nonfinite"}}
TARGETS = [("iteration, guard nonfinite / monitored", "guard nonfinite", 1.03),
           ("iteration, guard nonfinite,spikes / monitored", "guard nonfinite,spikes", 1.05),
           ("iteration, guard with alerts and stop_on / monitored", "guard + alerts + stop_on", None)]
"""(what, mode, target or None): the iteration ratios to ``monitored`` printed."""
GUARDED: list = []
"""The guarded optimizers built, whose skips are printed (none in a healthy run)."""


def build(mode: str, device: torch.device):
    """The model and optimizer of ``mode``, seeded alike."""
    torch.manual_seed(0)
    model = TinyLM().to(device)
    if MODES[mode] is None:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(
        backend="none", every=10, **MODES[mode]))
    if opt.monitor._guard is not None:
        GUARDED.append(opt)
    return model, opt


def main() -> None:
    _, it = tinylm_modes(__doc__, MODES, build)
    for what, mode, target in TARGETS:
        ratio = it[mode] / it["monitored"]
        verdict = "" if target is None else f" (target <= {target}: {'met' if ratio <= target else 'NOT met'})"
        print(f"{what}: {ratio:.3f}{verdict}")
    skipped = [opt.monitor._guard.skipped for opt in GUARDED]
    print(f"steps the guard skipped in these healthy runs: {skipped}")


if __name__ == "__main__":
    main()

"""What the ``histograms`` family costs, side by side in one process on the benchmark's model.

    python benchmarks/histograms.py [--rounds 8] [--device cpu]

AdamW on TinyLM (benchmarks/overhead.py: 75 tensors, 1.7 M parameters), backend none. Modes, run in
interleaved rounds of ten iterations each, so that drift of a shared machine hits all of them alike:

* ``plain``: the optimizer alone;
* ``eager every=1`` / ``eager+hist every=1``: every step a logging step with the eager capture
  (``compile=False``, the CPU default), without and with the ``histograms`` family (the default
  families otherwise);
* ``fused every=1`` / ``fused+hist every=1``: the same with ``compile=True`` (its graphs compiled in
  the warm-up round, before any timing);
* ``eager every=10`` / ``eager+hist every=10``: the eager capture logging on every tenth step.

Prints, per mode, the median over rounds of the mean ``opt.step()`` time and of the mean iteration
time (forward, backward, step), then the ratios the issue asks for: each route's logging step with
histograms to the one without (target <= 1.3), the logging step without histograms to the plain
step (fused <= 2.0, eager <= 4.0), and the every=10 iteration with histograms to plain's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import TinyLM, tinylm_modes  # noqa: E402

from monitored_optim import Monitored, MonitorConfig  # noqa: E402

DEFAULT = "update_to_data,grad_to_data,norms,lr,health,update_lost,spikes,monitor"
HIST = DEFAULT + ",histograms"
MODES = {"plain": None, "eager every=1": (DEFAULT, 1, False), "eager+hist every=1": (HIST, 1, False),
         "fused every=1": (DEFAULT, 1, True), "fused+hist every=1": (HIST, 1, True),
         "eager every=10": (DEFAULT, 10, False), "eager+hist every=10": (HIST, 10, False)}
TARGETS = [("eager logging step with histograms / without", "eager+hist every=1", "eager every=1", "step", 1.3),
           ("fused logging step with histograms / without", "fused+hist every=1", "fused every=1", "step", 1.3),
           ("fused logging step / plain step", "fused every=1", "plain", "step", 2.0),
           ("eager logging step / plain step", "eager every=1", "plain", "step", 4.0),
           ("fused logging step with histograms / plain step", "fused+hist every=1", "plain", "step", None),
           ("eager logging step with histograms / plain step", "eager+hist every=1", "plain", "step", None),
           ("every=10 iteration with histograms / plain", "eager+hist every=10", "plain", "iter", 1.03)]
"""(what, mode, over, step or iteration time, target or None): the ratios printed."""


def build(mode: str, device: torch.device):
    """The model and optimizer of ``mode``, seeded alike."""
    torch.manual_seed(0)
    model = TinyLM().to(device)
    if MODES[mode] is None:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    figures, every, compiled = MODES[mode]
    return model, Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(
        backend="none", every=every, figures=figures, compile=compiled))


def main() -> None:
    step, it = tinylm_modes(__doc__, MODES, build)
    times = {"step": step, "iter": it}
    for what, mode, over, kind, target in TARGETS:
        ratio = times[kind][mode] / times[kind][over]
        verdict = "" if target is None else f" (target <= {target}: {'met' if ratio <= target else 'NOT met'})"
        print(f"{what}: {ratio:.3f}{verdict}")


if __name__ == "__main__":
    main()

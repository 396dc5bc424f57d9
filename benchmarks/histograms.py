"""What the ``histograms`` family costs, side by side in one process on the benchmark's model.

    python benchmarks/histograms.py [--rounds 8] [--device cpu]

AdamW on TinyLM (benchmarks/overhead.py: 75 tensors, 1.7 M parameters). Modes, run in interleaved
rounds of ten iterations each, so that drift of a shared machine hits all of them alike:

* ``plain``: the optimizer alone;
* ``default every=1`` / ``+histograms every=1``: every step a logging step, without and with the
  ``histograms`` family (the default families otherwise; ``compile="auto"``, backend none);
* ``default every=10`` / ``+histograms every=10``: the same, logging on every tenth step.

Prints, per mode, the median over rounds of the mean ``opt.step()`` time and of the mean iteration
time (forward, backward, step), and the ratios the issue asks for: the logging step with histograms
to the one without (target <= 1.3), and the every=10 iteration with histograms to plain's (target
<= 1.03).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import BATCH, SEQ, VOCAB, TinyLM, iteration  # noqa: E402

from monitored_optim import Monitored, MonitorConfig  # noqa: E402

DEFAULT = "update_to_data,grad_to_data,norms,lr,health,update_lost,spikes,monitor"
MODES = {"plain": None, "default every=1": (DEFAULT, 1), "+histograms every=1": (DEFAULT + ",histograms", 1),
         "default every=10": (DEFAULT, 10), "+histograms every=10": (DEFAULT + ",histograms", 10)}


def build(mode: str, device: torch.device):
    """The model and optimizer of ``mode``, seeded alike."""
    torch.manual_seed(0)
    model = TinyLM().to(device)
    if MODES[mode] is None:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    figures, every = MODES[mode]
    return model, Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(
        backend="none", every=every, figures=figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(2)
    built = {mode: build(mode, device) for mode in MODES}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0)).to(device)
    steps = {mode: [] for mode in MODES}
    iters = {mode: [] for mode in MODES}
    for r in range(args.rounds + 1):  # round 0 warms up
        for mode, (model, opt) in built.items():
            timings = {"step": [], "iter": []}
            for _ in range(10):
                iteration(model, opt, tokens, timings)
            if r:
                steps[mode].append(statistics.mean(timings["step"]))
                iters[mode].append(statistics.mean(timings["iter"]))
    step = {mode: statistics.median(v) for mode, v in steps.items()}
    it = {mode: statistics.median(v) for mode, v in iters.items()}
    print(f"AdamW on TinyLM, {device}, {args.rounds} rounds of 10 iterations, torch {torch.__version__}")
    print(f"{'mode':<22} {'step ms':>8} {'iteration ms':>13} {'iteration / plain':>18}")
    for mode in MODES:
        print(f"{mode:<22} {1e3 * step[mode]:>8.2f} {1e3 * it[mode]:>13.2f} {it[mode] / it['plain']:>18.3f}")
    logging = step["+histograms every=1"] / step["default every=1"]
    amortized = it["+histograms every=10"] / it["plain"]
    print(f"logging step with histograms / without: {logging:.3f} (target <= 1.3: "
          f"{'met' if logging <= 1.3 else 'NOT met'})")
    print(f"every=10 iteration with histograms / plain: {amortized:.3f} (target <= 1.03: "
          f"{'met' if amortized <= 1.03 else 'NOT met'})")


if __name__ == "__main__":
    main()

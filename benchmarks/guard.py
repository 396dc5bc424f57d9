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

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import BATCH, SEQ, VOCAB, TinyLM, interleaved  # noqa: E402

from monitored_optim import Monitored, MonitorConfig  # noqa: E402

MODES = {"plain": None, "monitored": {}, "guard nonfinite": {"guard": "nonfinite"},
         "guard nonfinite,spikes": {"guard": "nonfinite,spikes"},
         "guard + alerts + stop_on": {"guard": "nonfinite,spikes", "alerts": "all", "stop_on": "nonfinite"}}
TARGETS = [("iteration, guard nonfinite / monitored", "guard nonfinite", 1.03),
           ("iteration, guard nonfinite,spikes / monitored", "guard nonfinite,spikes", 1.05),
           ("iteration, guard with alerts and stop_on / monitored", "guard + alerts + stop_on", None)]
"""(what, mode, target or None): the iteration ratios to ``monitored`` printed."""


def build(mode: str, device: torch.device):
    """The model and optimizer of ``mode``, seeded alike."""
    torch.manual_seed(0)
    model = TinyLM().to(device)
    if MODES[mode] is None:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(
        backend="none", every=10, **MODES[mode]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(2)
    built = {mode: build(mode, device) for mode in MODES}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0)).to(device)
    step, it = interleaved(built, tokens, args.rounds)
    print(f"AdamW on TinyLM, every=10, {device}, {args.rounds} rounds of 10 iterations, torch {torch.__version__}")
    print(f"{'mode':<26} {'step ms':>8} {'step / plain':>13} {'iteration ms':>13} {'iteration / plain':>18}")
    for mode in MODES:
        print(f"{mode:<26} {1e3 * step[mode]:>8.2f} {step[mode] / step['plain']:>13.3f} {1e3 * it[mode]:>13.2f} "
              f"{it[mode] / it['plain']:>18.3f}")
    for what, mode, target in TARGETS:
        ratio = it[mode] / it["monitored"]
        verdict = "" if target is None else f" (target <= {target}: {'met' if ratio <= target else 'NOT met'})"
        print(f"{what}: {ratio:.3f}{verdict}")
    skipped = [opt.monitor.guard.skipped for mode, (_, opt) in built.items() if mode.startswith("guard")]
    print(f"steps the guard skipped in these healthy runs: {skipped}")


if __name__ == "__main__":
    main()

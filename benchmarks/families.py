"""What each figure family costs per logging step, on the benchmark's model (benchmarks/overhead.py).

    python benchmarks/families.py [--rounds 8]

Times ``opt.step()`` of AdamW on TinyLM (75 tensors, 1.7 M parameters), every step a logging step,
for the plain optimizer and for monitors with: the core families only, the default (core +
``spikes``), default + ``state``, default + ``spectral``, and ``all``; rounds of ten steps of each
are interleaved so that every mode sees the same machine, and the medians over rounds are printed
in milliseconds and as the extra over the core families.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import BATCH, SEQ, VOCAB, TinyLM  # noqa: E402

from monitored_optim import Monitored, MonitorConfig  # noqa: E402

CORE = "update_to_data,grad_to_data,norms,lr,health,update_lost"
MODES = {"plain": None, "core": CORE, "default": None, "+state": CORE + ",spikes,state",
         "+spectral": CORE + ",spikes,spectral", "all": "all"}


def build(mode: str):
    torch.manual_seed(0)
    model = TinyLM()
    if mode == "plain":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    figures = MODES[mode]
    return model, Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(
        backend="none", every=1, figures=figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    built = {mode: build(mode) for mode in MODES}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    times = {mode: [] for mode in MODES}
    for r in range(args.rounds + 1):  # round 0 warms up
        for mode, (model, opt) in built.items():
            spent = []
            for _ in range(10):
                loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB),
                                                         tokens[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                t = time.perf_counter()
                opt.step()
                spent.append(time.perf_counter() - t)
            if r:
                times[mode].append(statistics.mean(spent))
    core = statistics.median(times["core"])
    print(f"{'mode':<10} {'step ms':>8} {'extra over core ms':>19}")
    for mode, values in times.items():
        ms = statistics.median(values)
        print(f"{mode:<10} {1e3 * ms:>8.2f} {1e3 * (ms - core):>19.2f}")


if __name__ == "__main__":
    main()

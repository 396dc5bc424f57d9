"""What the logging period costs: the monitor at every=1, 10 and 100 beside the plain optimizer, in one process.

    python benchmarks/cadence.py [--rounds 4] [--optimizers adamw,sgd] [--capture eager] [--threads N]

The model is ``overhead.py``'s small transformer language model (75 tensors, 1.7 M parameters).
Modes run in interleaved rounds of 100 iterations each (so every=100 logs exactly once per round and
drift of the shared machine hits all modes alike): ``plain``, and ``Monitored(cls)`` with the eager
capture (``compile=False``, the default on CPUs; ``--capture fused`` for the CUDA default) logging
every 1, 10 and 100 steps (backend none). Prints, per optimizer, the step and the full-iteration
(forward, backward, step) times as ratios to ``plain``: the median over rounds of each round's mean,
so a period above 1 is amortized over its logging steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import BATCH, SEQ, VOCAB, build, iteration  # noqa: E402

PERIODS = (1, 10, 100)
ROUND = 100
"""Iterations per mode and round: a multiple of every period."""


def bench(cls, kwargs, rounds: int, capture: str, device: str) -> dict[str, dict[str, float]]:
    """Per mode, the median over ``rounds`` of each round's mean step and iteration time (seconds)."""
    modes = ["plain", *(f"{capture} every={n}" for n in PERIODS)]
    runs = {m: build(m, cls, kwargs, device) for m in modes}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device)
    for m in modes:  # warm-up: state exists, graphs are compiled, every period has logged once
        for _ in range(max(PERIODS) + 1):
            iteration(*runs[m], tokens, {"step": [], "iter": []})
    rounds_of = {m: {"step": [], "iter": []} for m in modes}
    for _ in range(rounds):
        for m in modes:
            timings = {"step": [], "iter": []}
            for _ in range(ROUND):
                iteration(*runs[m], tokens, timings)
            for k, v in timings.items():
                rounds_of[m][k].append(statistics.mean(v))
    return {m: {k: statistics.median(v) for k, v in t.items()} for m, t in rounds_of.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--capture", choices=("eager", "fused"), default="eager")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    choices = {"adamw": (torch.optim.AdamW, dict(lr=1e-3)),
               "sgd": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9))}
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, {args.rounds} "
          f"rounds of {ROUND} iterations, {args.capture} capture")
    start = time.perf_counter()
    for name in args.optimizers.split(","):
        med = bench(*choices[name], args.rounds, args.capture, args.device)
        plain = med["plain"]
        print(f"\n{name}: plain step {plain['step'] * 1e3:.2f} ms, iteration {plain['iter'] * 1e3:.1f} ms")
        print(f"{'mode':<18}{'step / plain':>14}{'iteration / plain':>20}")
        for mode, t in med.items():
            print(f"{mode:<18}{t['step'] / plain['step']:>14.3f}{t['iter'] / plain['iter']:>20.3f}")
    print(f"\nbenchmark time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

"""Train a small MLP on scikit-learn's bundled handwritten digits with a monitored AdamW.

    python examples/digits.py            # logs to TensorBoard under runs/ (the default backend)
    MONITORED_OPTIM_BACKEND=jsonl python examples/digits.py

The only change from a plain PyTorch loop is ``Monitored(torch.optim.AdamW)``. At the end it prints
each layer's update-to-data ratio, log10(std(update) / std(weights)), as the median over the last 20
logged steps (the report's rule), and marks weight matrices whose median is outside the healthy band
[-4, -2] around Karpathy's rule of thumb of -3 (biases are vectors, which the band does not judge).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

from monitored_optim import Monitored

HEALTHY = (-4.0, -2.0)


def data(seed: int):
    """The 1,797 8x8 digit images as float32 features in [0, 1] and int64 labels, split 80/20."""
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)
    as_t = lambda a, dt: torch.tensor(a, dtype=dt)  # noqa: E731
    return as_t(x_tr, torch.float32), as_t(y_tr, torch.int64), as_t(x_te, torch.float32), as_t(y_te, torch.int64)


def model() -> nn.Module:
    return nn.Sequential(OrderedDict(fc1=nn.Linear(64, 128), act1=nn.ReLU(), fc2=nn.Linear(128, 64),
                                     act2=nn.ReLU(), head=nn.Linear(64, 10)))


WINDOW = 20
"""Logged steps the table's medians cover: the same rule as ``python -m monitored_optim report``."""


def ratio_table(history: list[dict[str, float]], matrices: set[str]) -> str:
    """One row per parameter: the median of its update-to-data ratio over the last :data:`WINDOW`
    logged steps (``history``: ``opt.monitor.latest`` of each logging step), and for a weight matrix
    (``matrices``) a mark when that median is outside the healthy band, the rule the report uses;
    three decimals where two would round onto a band edge. A vector (bias, norm gain) is not judged
    by the band: its small spread makes its ratio read higher, so watch its trend instead."""
    window = history[-WINDOW:]
    names = [tag.split("/", 1)[1] for tag in window[-1] if tag.startswith("update_to_data/")]
    width = max([len("parameter")] + [len(name) for name in names])
    lines = [f"{'parameter':<{width}}  update_to_data", f"{'-' * width}  --------------"]
    for name in names:
        value = statistics.median(row[f"update_to_data/{name}"] for row in window if f"update_to_data/{name}" in row)
        if name not in matrices:
            mark = "  (vector: not judged by the band)"
        elif HEALTHY[0] <= value <= HEALTHY[1]:
            mark = ""
        else:
            mark = "  <- barely moves" if value < HEALTHY[0] else "  <- thrashing"
        digits = 3 if any(abs(value - edge) < 0.005 and value != edge for edge in HEALTHY) else 2
        lines.append(f"{name:<{width}}  {value:>14.{digits}f}{mark}")
    return "\n".join(lines)


HEALTH = {
    "health/no_grad": "parameters with no gradient: frozen (requires_grad=False) or unused in forward",
    "health/unchanged": "parameters with a gradient that did not move: zero gradient (dead ReLU), lr 0, "
                        "or updates lost to bf16/fp16 rounding (raise lr or keep fp32 master weights)",
    "health/nonfinite": "parameters with NaN/Inf: lower the lr, clip gradients, check for overflow",
    "health/skipped_steps": "steps skipped by AMP loss scaling (a few early on are normal)",
}


def health_summary(latest: dict[str, float]) -> str:
    """One line per health count of the last logging step, with what to do when it is not zero."""
    lines = ["\nHealth at the last logging step:"]
    for tag, advice in HEALTH.items():
        count = int(latest.get(tag, 0))
        lines.append(f"  {tag.split('/')[1]:<14} {count:>3}" + (f"  <- {advice}" if count else ""))
    return "\n".join(lines)


def wandb_run_dir() -> str | None:
    """The directory of the active W&B run (``<WANDB_DIR>/wandb/<run>``), if one is open."""
    wandb = sys.modules.get("wandb")
    run = None if wandb is None else wandb.run
    return None if run is None else str(Path(run.dir).parent)


def where_logged(settings, run_dir: str | None = None) -> str:
    """Where each backend wrote (``run_dir``: the W&B run's directory), and the command that opens it."""
    lines = []
    for backend in settings.backends:
        if backend == "tensorboard":
            lines.append(f"TensorBoard events in {settings.logdir}; open with: tensorboard --logdir {settings.logdir}")
        elif backend == "jsonl":
            lines.append(f"JSON lines in {settings.logdir / 'metrics.jsonl'}")
        elif backend == "wandb":
            offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun")
            lines.append(f"W&B run in {run_dir}" + (f"; upload it with: wandb sync {run_dir}" if offline else "")
                         if run_dir else "W&B: no run was opened")
        else:  # mlflow, trackio, swanlab, comet: in their own stores (docs/guides/looking.md)
            lines.append(f"{backend}: the figures are in {backend}'s own run (see docs/guides/looking.md)")
    if {"tensorboard", "jsonl"} & set(settings.backends):
        lines.append(f"Table and plot: python -m monitored_optim report {settings.logdir} "
                     f"--plot {settings.logdir / 'update_to_data.png'}")
    return "\n" + ("\n".join(lines) if lines else "Nothing was logged (MONITORED_OPTIM_BACKEND=none).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30, help="passes over the 1,437 training images")
    parser.add_argument("--batch-size", type=int, default=64, help="images per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for the split, weights and batches")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = data(args.seed)
    net = model()
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), lr=args.lr, weight_decay=1e-2)
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    history = []  # the figures of each logging step, for the table's medians
    bar = tqdm(range(args.epochs), desc="epochs", unit="epoch")
    for _ in bar:
        for idx in torch.randperm(len(x_tr)).split(args.batch_size):
            loss = loss_fn(net(x_tr[idx]), y_tr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if opt.monitor.latest:
                history.append(opt.monitor.latest)
        bar.set_postfix(loss=f"{loss.item():.3f}", step=opt.monitor.step)
    with torch.no_grad():
        accuracy = (net(x_te).argmax(1) == y_te).float().mean().item()
    run_dir = wandb_run_dir()  # before close() finishes the run
    opt.monitor.close()

    print(f"\n{opt.monitor.step} optimizer steps in {time.perf_counter() - start:.1f} s, "
          f"test accuracy {accuracy:.3f}")
    print(f"\nUpdate-to-data ratio, median over the last {min(WINDOW, len(history))} logged steps (healthy near -3, "
          f"band {list(HEALTHY)} for weight matrices):")
    print(ratio_table(history, {n for n, p in net.named_parameters() if p.dim() >= 2}))
    print(health_summary(opt.monitor.latest))
    print(where_logged(opt.monitor.settings, run_dir))

if __name__ == "__main__":
    main()

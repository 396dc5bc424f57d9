"""DeepSpeed ZeRO: the monitored optimizer's step beside the plain one, in one run.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 benchmarks/deepspeed_zero.py --stage 2
    torchrun --standalone --nproc_per_node=2 benchmarks/deepspeed_zero.py --stage 3 --bf16      # GPUs

For each mode (plain AdamW, monitored every=10, monitored every=1), on the same model (a stack of
``--layers`` Linear(width, width) with LayerNorms, two param groups as the HF Trainer makes) and the
same batches: the mean time of ``engine.step()`` after warm-up, as a ratio to plain, with the
collectives it issues per step (counted while it runs). Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")  # before deepspeed's import

import deepspeed  # noqa: E402

from monitored_optim import Monitored, MonitorConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_distributed import CountCollectives  # noqa: E402


def model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*blocks)


def run(mode: str, args: argparse.Namespace) -> tuple[list[float], int]:
    net = model(args.layers, args.width)
    named = list(net.named_parameters())
    groups = [{"params": [p for n, p in named if p.dim() >= 2], "param_names": [n for n, p in named if p.dim() >= 2]},
              {"params": [p for n, p in named if p.dim() < 2], "param_names": [n for n, p in named if p.dim() < 2],
               "weight_decay": 0.0}]
    if mode == "plain":
        opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)
    else:
        opt = Monitored(torch.optim.AdamW)(groups, lr=1e-3, weight_decay=0.1,
                                           monitor=MonitorConfig(backend="none", every=int(mode.split("=")[1])))
    config = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {"stage": args.stage},
              "bf16": {"enabled": args.bf16}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    times, ops = [], 0
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(step)).to(engine.device, dtype)
        engine.backward(engine(x).float().square().mean())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        with CountCollectives() as c:
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            ops += len(c.ops)
    return times, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rows = {mode: run(mode, args) for mode in ("plain", "every=10", "every=1")}
    if torch.distributed.get_rank() == 0:
        base = statistics.mean(rows["plain"][0])
        params = sum(p.numel() for p in model(args.layers, args.width).parameters())
        print(f"ZeRO stage {args.stage}, {'bf16' if args.bf16 else 'fp32'}, "
              f"{torch.distributed.get_world_size()} ranks, "
              f"{params / 1e6:.2f} M parameters, {args.steps} timed steps; plain engine.step() {base * 1e3:.1f} ms")
        print(f"{'mode':<10} {'step / plain':>12} {'collectives per step':>21}")
        for mode, (times, ops) in rows.items():
            print(f"{mode:<10} {statistics.mean(times) / base:>12.3f} {ops / args.steps:>21.2f}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

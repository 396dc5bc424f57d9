"""Train the digits MLP under DeepSpeed ZeRO, monitored per layer under the model's own names.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 examples/digits_deepspeed.py --stage 2
    torchrun --standalone --nproc_per_node=2 examples/digits_deepspeed.py --stage 3 --bf16   # GPUs

Same data, model and figures as ``examples/digits.py``; the changes for DeepSpeed are the engine
(``deepspeed.initialize`` with the monitored optimizer), ``engine.backward`` and ``engine.step``.
At stages 1-3 DeepSpeed hands the optimizer one flat fp32 partition per param group instead of the
model's parameters; the monitor maps each partition back to the model's parameters, so
``opt.monitor.latest`` holds the figures of the whole ``fc1.weight``, ``head.bias``, ... (padding
excluded), the same on every rank, combined with one all_reduce per logging step, and the x axis
counts the engine's optimizer steps. Only rank 0 writes the logs and prints.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from tqdm import tqdm

os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")  # before deepspeed's import

import deepspeed  # noqa: E402

from digits import HEALTHY, data, health_summary, model, ratio_table, where_logged  # noqa: E402  examples/digits.py
from monitored_optim import Monitored  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--bf16", action="store_true", help="train in bf16 (fp32 master weights)")
    parser.add_argument("--epochs", type=int, default=30, help="passes over the 1,437 training images")
    parser.add_argument("--batch-size", type=int, default=64, help="images per optimizer step, all ranks together")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for the split, weights and batches")
    args = parser.parse_args()

    deepspeed.init_distributed()  # gloo on the CPU, nccl on GPUs
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(args.seed)  # the same weights and the same batch order on every rank
    net = model()
    decay = [(n, p) for n, p in net.named_parameters() if p.dim() >= 2]
    rest = [(n, p) for n, p in net.named_parameters() if p.dim() < 2]
    opt = Monitored(torch.optim.AdamW)(  # two groups: DeepSpeed steps each one separately, one step counted
        [{"params": [p for _, p in decay], "param_names": [n for n, _ in decay], "weight_decay": 1e-2},
         {"params": [p for _, p in rest], "param_names": [n for n, _ in rest], "weight_decay": 0.0}], lr=args.lr)
    config = {"train_micro_batch_size_per_gpu": args.batch_size // world, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": args.stage}, "bf16": {"enabled": args.bf16},
              "zero_allow_untested_optimizer": True}  # DeepSpeed checks the exact class at stages 1-3
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    x_tr, y_tr, x_te, y_te = (t.to(engine.device) for t in data(args.seed))
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    bar = tqdm(range(args.epochs), desc="epochs", unit="epoch", disable=rank != 0)
    for _ in bar:
        for idx in torch.randperm(len(x_tr)).split(args.batch_size):
            mine = idx.tensor_split(world)[rank]  # this rank's slice of the global batch
            loss = loss_fn(engine(x_tr[mine].to(dtype)).float(), y_tr[mine])
            engine.backward(loss)
            engine.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", step=opt.monitor.step)
    with torch.no_grad():  # every rank takes part in the forward (stage 3 gathers the parameters)
        accuracy = (engine(x_te.to(dtype)).float().argmax(1) == y_te).float().mean().item()
    opt.monitor.close()

    if rank == 0:
        print(f"\nZeRO stage {args.stage} on {world} ranks, {opt.monitor.step} optimizer steps in "
              f"{time.perf_counter() - start:.1f} s, test accuracy {accuracy:.3f}")
        if args.stage:
            print("DeepSpeed steps one flat fp32 partition per group; the figures are of the model's parameters.")
        print(f"\nUpdate-to-data ratio at step {opt.monitor.step} (healthy near -3, band {list(HEALTHY)}):")
        print(ratio_table([opt.monitor.latest], {n for n, p in decay}))
        print(health_summary(opt.monitor.latest))
        print(where_logged(opt.monitor.settings))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

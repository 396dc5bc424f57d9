"""Train the digits MLP sharded across processes with FSDP2, monitored per layer as a whole.

    torchrun --standalone --nproc_per_node=2 examples/digits_fsdp.py     # CPU: gloo; one GPU each: nccl
    MONITORED_OPTIM_BACKEND=jsonl torchrun --standalone --nproc_per_node=2 examples/digits_fsdp.py

Same data, model and figures as ``examples/digits.py``; the only changes for distributed training
are the process group, ``fully_shard`` on each layer and each rank taking its slice of every batch.
Each rank holds a shard of every parameter (``fc2.weight`` is split 32/32 rows on 2 ranks,
``head.bias`` 5/5), yet ``opt.monitor.latest`` holds the figures of the whole parameters, the same on
every rank, combined with one all_reduce per logging step; only rank 0 writes the logs and prints.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from tqdm import tqdm

from digits import HEALTHY, data, health_summary, model, ratio_table, where_logged  # examples/digits.py
from monitored_optim import Monitored


def setup() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...):
    NCCL with one GPU per process when there are enough GPUs, else gloo on the CPU."""
    local_rank, world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30, help="passes over the 1,437 training images")
    parser.add_argument("--batch-size", type=int, default=64, help="images per optimizer step, all ranks together")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for the split, weights and batches")
    args = parser.parse_args()

    rank, world, device = setup()
    torch.manual_seed(args.seed)  # the same weights and the same batch order on every rank
    x_tr, y_tr, x_te, y_te = (t.to(device) for t in data(args.seed))
    net = model().to(device)
    for layer in (net.fc1, net.fc2, net.head):
        fully_shard(layer)
    fully_shard(net)
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), lr=args.lr, weight_decay=1e-2)
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    bar = tqdm(range(args.epochs), desc="epochs", unit="epoch", disable=rank != 0)
    for _ in bar:
        for idx in torch.randperm(len(x_tr)).split(args.batch_size):
            mine = idx.tensor_split(world)[rank].to(device)  # this rank's slice of the global batch
            loss = loss_fn(net(x_tr[mine]), y_tr[mine])
            opt.zero_grad(set_to_none=True)
            loss.backward()  # FSDP2 averages the gradients over the ranks (reduce-scatter)
            opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", step=opt.monitor.step)
    with torch.no_grad():  # every rank takes part in the forward (it gathers the shards)
        accuracy = (net(x_te).argmax(1) == y_te).float().mean().item()
    opt.monitor.close()

    shard = {name: tuple(p.to_local().shape) for name, p in net.named_parameters()}
    if rank == 0:
        print(f"\n{world} ranks, {opt.monitor.step} optimizer steps in {time.perf_counter() - start:.1f} s, "
              f"test accuracy {accuracy:.3f}")
        print(f"Rank 0 holds the shards {shard}; the figures are of the whole parameters.")
        print(f"\nUpdate-to-data ratio at step {opt.monitor.step} (healthy near -3, band {list(HEALTHY)}):")
        print(ratio_table([opt.monitor.latest], {n for n, p in net.named_parameters() if p.dim() >= 2}))
        print(health_summary(opt.monitor.latest))
        print(where_logged(opt.monitor.settings))
    dist.barrier()  # no rank tears its process group down while another still prints or talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

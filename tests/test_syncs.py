"""Host synchronisations: none on non-logging steps and at most one per logging step beyond what
the plain optimizer's own step does. Counted as ``aten._local_scalar_dense`` calls (``.item()``,
``float(t)``, ``bool(t)``) and copies to the CPU from another device, seen by a TorchDispatchMode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import models
from monitored_optim import Monitored, MonitorConfig


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            dst_cpu = (kwargs.get("device") == torch.device("cpu")) if func is torch.ops.aten._to_copy.default \
                else args[0].device.type == "cpu"
            if dst_cpu and src.device.type != "cpu":
                self.count += 1
        return func(*args, **kwargs)


def syncs_per_step(cls, kwargs, monitor, steps=4):
    problem = models.mlp()
    opt = cls(problem.groups, **kwargs, **({"monitor": monitor} if monitor else {}))
    counts = []
    for i in range(steps):
        opt.zero_grad()
        problem.loss(i).backward()
        with SyncCounter() as counter:
            opt.step()
        counts.append(counter.count)
    return counts


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.AdamW, dict(lr=1e-2)),
    (torch.optim.AdamW, dict(lr=torch.tensor(1e-2), foreach=False)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.SGD, dict(lr=torch.tensor(0.1))),
], ids=["adamw", "adamw-tensor-lr", "sgd-nesterov", "sgd-tensor-lr"])
def test_at_most_one_sync_per_logging_step_and_none_otherwise(cls, kwargs):
    plain = syncs_per_step(cls, kwargs, None)
    monitored = syncs_per_step(Monitored(cls), kwargs, MonitorConfig(backend="none", every=2))
    extra = [m - p for m, p in zip(monitored, plain)]
    assert extra[0] == 0 and extra[2] == 0, (plain, monitored)  # steps 1, 3: not logging steps
    assert extra[1] <= 1 and extra[3] <= 1, (plain, monitored)  # steps 2, 4: one table copy at most

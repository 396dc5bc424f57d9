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
@pytest.mark.parametrize("figures", [None, "default,histograms"])  # the histograms' counts, extremes and sums too
def test_at_most_one_sync_per_logging_step_and_none_otherwise(cls, kwargs, figures):
    plain = syncs_per_step(cls, kwargs, None)
    monitored = syncs_per_step(Monitored(cls), kwargs, MonitorConfig(backend="none", every=2, figures=figures))
    extra = [m - p for m, p in zip(monitored, plain)]
    assert extra[0] == 0 and extra[2] == 0, (plain, monitored)  # steps 1, 3: not logging steps
    assert extra[1] <= 1 and extra[3] <= 1, (plain, monitored)  # steps 2, 4: one table copy at most


class OpLog(TorchDispatchMode):
    """Every aten op dispatched, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def ops_per_step(cls, kwargs, monitor, steps=4):
    lbfgs = issubclass(cls, torch.optim.LBFGS)
    problem = models.mlp(two_groups=not lbfgs)
    opt = cls(problem.groups, **kwargs, **({"monitor": monitor} if monitor else {}))
    logs = []
    for i in range(steps):
        closure = problem.closure(opt, i)
        closure()
        with OpLog() as log:
            opt.step(closure) if lbfgs else opt.step()
        logs.append(log.ops)
    return logs


O = torch.optim


@pytest.mark.parametrize("cls,kwargs", [
    (O.SGD, dict(lr=0.1, momentum=0.9)), (O.Adam, dict(lr=1e-2)), (O.AdamW, dict(lr=1e-2, amsgrad=True)),
    (O.Adamax, dict(lr=1e-2)), (O.Adagrad, dict(lr=1e-2, weight_decay=0.1)), (O.Adadelta, dict(lr=1.0)),
    (O.RMSprop, dict(lr=1e-2, momentum=0.9)), (O.Rprop, dict(lr=1e-2)), (O.ASGD, dict(lr=1e-2)),
    (O.NAdam, dict(lr=1e-2, weight_decay=0.1)), (O.RAdam, dict(lr=1e-2)), (O.Adafactor, dict(lr=1e-2)),
    (O.LBFGS, dict(lr=0.5)),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_non_logging_steps_dispatch_exactly_the_plain_optimizers_ops(cls, kwargs):
    """No tensor work at all on a step that does not log: the same aten ops, in the same order, as
    the plain optimizer's step (so no sync, no allocation, no kernel of ours). Logging steps differ
    (the check that the comparison can fail)."""
    plain = ops_per_step(cls, kwargs, None)
    monitored = ops_per_step(Monitored(cls), kwargs, MonitorConfig(backend="none", every=2))
    assert monitored[0] == plain[0] and monitored[2] == plain[2]  # steps 1, 3
    assert len(monitored[1]) > len(plain[1]) and len(monitored[3]) > len(plain[3])  # steps 2, 4 log

"""Child process of test_lowbit.py: the extra peak memory of a logging step of one low-bit or projected
optimizer, in a fresh process. Usage: ``python lowbit_child.py MODULE CLASS``; prints one JSON line:
``{"plain": bytes, "logged": bytes, "reference": bytes, "largest": bytes, "params": bytes}``, the peaks
of what the measured step allocates (``benchmarks/memory.py``'s ``allocated_peak``: every allocation of
the CPU allocator, those of torchao's compiled step included), plain and monitored, after two steps that
build the optimizer's state; ``reference``: what a logging step of plain SGD, whose view rebuilds u from
the grad, allocates beyond its plain step on the same model (the capture's own buffers: its workspace,
the sums)."""

import importlib
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from memory import allocated_peak  # noqa: E402

from lowbit import build, model  # noqa: E402
from monitored_optim import Monitored, MonitorConfig  # noqa: E402

warnings.filterwarnings("ignore")  # torchao's and GaLore's own notices


def measured(cls, monitored: bool) -> tuple[int, int, int]:
    net = model()
    named = list(net.named_parameters())
    opt = build(Monitored(cls) if monitored else cls, named,
                **({"monitor": MonitorConfig(backend="none", every=3)} if monitored else {}))
    x = torch.randn(8, net[0].in_features)
    for _ in range(3):  # the third step logs
        opt.zero_grad()
        net(x).square().mean().backward()
        if _ < 2:
            opt.step()
    peak = allocated_peak(opt.step)
    sizes = [p.numel() * p.element_size() for _, p in named]
    return peak, max(sizes), sum(sizes)


if __name__ == "__main__":
    module, name = sys.argv[1:3]
    cls = getattr(importlib.import_module(module), name)
    plain, largest, params = measured(cls, False)
    logged, _, _ = measured(cls, True)
    reference = measured(torch.optim.SGD, True)[0] - measured(torch.optim.SGD, False)[0]
    print(json.dumps({"plain": plain, "logged": logged, "reference": reference, "largest": largest, "params": params}))

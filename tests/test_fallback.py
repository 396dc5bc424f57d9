"""The clone fallback on real third-party optimizers that have no view (pytorch-optimizer's): the
figures equal the clone truth, ``describe()`` names the fallback, and the trajectory is the plain
optimizer's bit for bit. (torchao's low-bit AdamW, whose state is quantized, is measured in its turn of
the step instead: tests/test_lowbit.py.)"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import truth
from monitored_optim import Monitored, MonitorConfig

FALLBACK = [*(("pytorch_optimizer", name) for name in (
    "AdaBelief", "AdamP", "Adan", "Lamb", "MADGRAD", "Ranger", "DAdaptAdam", "Tiger", "ADOPT", "AdEMAMix", "SOAP",
    "CAME", "LARS", "SGDW", "Adai", "StableAdamW", "Kron", "LaProp", "MARS", "SPAM"))]
"""(module, class) of optimizers without a view: pytorch-optimizer 4.1's (the docs' list of what the
fallback serves)."""
LR = {"DAdaptAdam": 1.0}
"""Learning rates other than 1e-3 (D-Adaptation's lr multiplies its estimate d, which starts at 1e-6)."""
STEPS = 3


def _model() -> torch.nn.Module:
    """A matrix, its bias at 0 and a LayerNorm at 1.0 and 0, as real models start."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64))
    torch.nn.init.zeros_(model[0].bias)
    return model


def _run(module: str, name: str, monitor: MonitorConfig | None
         ) -> tuple[list[torch.Tensor], list[tuple[dict[str, float], dict[str, float]]], str]:
    """STEPS steps of ``module.name`` on :func:`_model` with seeded grads (torch's and Python's
    generators seeded alike, for the optimizers that draw): the parameters after, each step's
    figures beside the clone truth's, and ``describe()``."""
    cls = getattr(pytest.importorskip(module), name)
    model = _model()
    named = list(model.named_parameters())
    lr = LR.get(name, 1e-3)
    opt = cls(named, lr=lr) if monitor is None else Monitored(cls)(named, lr=lr, monitor=monitor)
    torch.manual_seed(1)
    random.seed(1)
    gen = torch.Generator().manual_seed(2)
    pairs = []
    for _ in range(STEPS):
        for _, p in named:
            p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
        before, grads = truth.snapshot(named)
        with warnings.catch_warnings():  # torchao's own notices on compiling its step (not the monitor's)
            warnings.filterwarnings("ignore", r".*(_stable_hash_for_caching|torch\.jit\.script_method)")
            opt.step()
        if monitor is not None:
            pairs.append((dict(opt.monitor.latest), truth.figures(named, before, grads)))
    return [p.detach().clone() for _, p in named], pairs, opt.monitor.describe() if monitor is not None else ""


@pytest.mark.parametrize("module,name", FALLBACK, ids=[name for _, name in FALLBACK])
def test_fallback_is_exact_and_keeps_the_trajectory(module, name, tmp_path):
    plain, _, _ = _run(module, name, None)
    after, pairs, described = _run(module, name, MonitorConfig(backend="none", logdir=tmp_path))
    assert "clone" in described.splitlines()[-1], described
    for logged, expected in pairs:
        truth.assert_figures_match(logged, expected)
    assert all(torch.equal(a, b) for a, b in zip(plain, after))

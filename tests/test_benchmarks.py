"""The benchmark's bounds do the work they stand for: ``eager kernels``' least eager capture gives the
stored change of every part (a bound that skipped work would make a target look impossible)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import overhead  # noqa: E402


@pytest.mark.parametrize("cls, kwargs", [(torch.optim.AdamW, dict(lr=1e-3)),
                                         (torch.optim.SGD, dict(lr=1e-2, momentum=0.9))], ids=["adamw", "sgd"])
def test_eager_kernels_give_every_parts_stored_change(cls, kwargs):
    """A 400 x 400 matrix (three parts of the 256 KiB chunk), a 256 x 256 one at 1.0 (a LayerNorm-like
    constant: its restoration) and a bias (flat): the norm and sum of u per part, as the hooks host
    them, equal the clone's p_after - p_before over three steps."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(0.02 * torch.randn(400, 400, generator=gen)),
              torch.nn.Parameter(torch.ones(256, 256)), torch.nn.Parameter(torch.zeros(400))]
    opt = cls(params, **kwargs)
    held = overhead.eager_kernels_hooks(opt)
    large = params[:2]
    limit = 1 << 16
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        before = [p.detach().clone() for p in large]
        opt.step()
        want = []
        for p, b in zip(large, before):
            u = (p.detach().double() - b.double()).reshape(-1)
            want += [(piece.sum().item(), piece.norm().item()) for piece in u.split(limit)]
        parts = len(want)
        got = held["host"][5 * parts:7 * parts]
        assert parts == 4
        for (total, norm), got_total, got_norm in zip(want, got[0::2], got[1::2]):
            assert got_norm == pytest.approx(norm, rel=1e-4) and norm > 0  # the figures' tolerance
            assert got_total == pytest.approx(total, rel=1e-4, abs=1e-6 * norm)


def test_an_iteration_is_judged_no_faster_than_its_step_time_gives():
    """The forward and backward passes are the same in every mode: an iteration measured below
    ``1 + (step ratio - 1) * step share`` (drift between the modes' timings) is judged on that value,
    so it cannot print as met (one run's SGD: 1.047 measured, 1.074 from its step time); one above it
    is judged as measured, and a step target on the step."""
    share = 2.30 / 95.86
    drifted = {"fused every=1": {"step": 4.095, "iter": 1.047}}
    value = overhead.judged(drifted, "fused every=1", "iter", share)
    assert value == pytest.approx(1 + 3.095 * share) and value > 1.07
    assert overhead.verdict(value, 1.05) == "NOT met"
    slower = {"fused every=1": {"step": 1.5, "iter": 1.2}}
    assert overhead.judged(slower, "fused every=1", "iter", 0.05) == 1.2
    assert overhead.judged(slower, "fused every=1", "step", 0.05) == 1.5


def test_memory_benchmark_measures_logging_steps(monkeypatch):
    """``benchmarks/memory.py`` on a small GPT-2-shaped model: its monitored steps are logging steps
    whatever the default cadence, so the clone fallback (AdaBelief, no view) shows its copy of the
    parameters and a view (AdamW) a small fraction of them."""
    pytest.importorskip("pytorch_optimizer")
    import memory

    monkeypatch.setattr(memory, "GPT2", dict(vocab=4096, width=128, blocks=2))
    monkeypatch.delenv("MONITORED_OPTIM_EVERY", raising=False)  # the default cadence, as a user runs it
    extra = {}
    for name in ("adabelief", "adamw"):
        plain, param_bytes = memory._steps(name, False, steps=2, track=True)
        logged, _ = memory._steps(name, True, steps=2, track=True)
        extra[name] = (logged - plain) / param_bytes
    assert extra["adabelief"] >= 0.95 and extra["adamw"] < 0.2, extra

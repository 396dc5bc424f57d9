"""Snapshots staged through host memory (the clone fallback on an accelerator), run on the host:
p_before goes to host memory before the step and comes back one part at a time after it."""

from __future__ import annotations

import torch
from torch import nn

import truth
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.capture import eager
from monitored_optim.updates import clone
from thirdparty import SignSGD


def test_staged_snapshots_come_back_a_part_at_a_time_and_equal_clone_truth(monkeypatch, tmp_path):
    """A third-party optimizer without a view, its parameters' device type staged (the path CUDA
    parameters take): every snapshot comes back to the parameter's device in parts of at most the
    capture's budget, covering each parameter once per logging step; the figures equal the clone
    truth and the trajectory is the plain optimizer's bit for bit."""
    monkeypatch.setattr(clone, "STAGED", frozenset({"cpu"}))
    fetched = []

    def counted(before, like):
        fetched.append(before.numel())
        return clone.fetched(before, like)

    monkeypatch.setattr(eager, "fetched", counted)
    runs = []
    for build in (SignSGD, Monitored(SignSGD)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 1024), nn.LayerNorm(1024), nn.Linear(1024, 8))
        named = list(model.named_parameters())
        extra = {"monitor": MonitorConfig(backend="none", logdir=tmp_path)} if build is not SignSGD else {}
        opt = build(named, lr=1e-3, **extra)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _, p in named:
                p.grad = torch.randn(p.shape, generator=gen)
            before, grads = truth.snapshot(named)
            fetched.clear()
            opt.step()
            if build is not SignSGD:
                truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))
                limit = opt.monitor._engine.capture.plan.budget // 4
                assert sum(fetched) == sum(p.numel() for _, p in named) and max(fetched) <= limit < 512 * 1024
        runs.append([p.detach().clone() for _, p in named])
    assert all(torch.equal(a, b) for a, b in zip(*runs))

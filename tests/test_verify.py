"""Verify mode: the state-aware update is compared with a clone on logging steps; a broken view is
caught and named. Also the public ``register`` hook that such a view comes through."""

from __future__ import annotations

import warnings

import pytest
import torch

import models
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.updates import register, view_for
from thirdparty import SignSGD


class SignView:
    """Correct view for SignSGD: u = -lr * sign(grad)."""

    def before(self, group, p, state):
        return None

    def update(self, group, p, state, snapshot):
        return None if p.grad is None else p.grad.sign() * -group["lr"]


class BrokenSignView(SignView):
    """Forgets the sign: u = -lr * grad."""

    def update(self, group, p, state, snapshot):
        return None if p.grad is None else p.grad * -group["lr"]


class SignSGD2(SignSGD):
    """A class of its own so that registering views for it leaves SignSGD alone."""

    @torch.no_grad()
    def step(self, closure=None):
        return super().step(closure)


def train(cls, config, steps=3):
    problem = models.mlp()
    opt = Monitored(cls)(problem.groups, lr=1e-2, monitor=config)
    for i in range(steps):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()
    return opt


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.AdamW, dict(lr=1e-2)),
                                        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
                                        (torch.optim.RMSprop, dict(lr=1e-2, centered=True))])
def test_verify_mode_agrees_for_builtin_views(cls, kwargs, monkeypatch):
    monkeypatch.setenv("MONITORED_OPTIM_VERIFY", "1")
    problem = models.mlp()
    opt = Monitored(cls)(problem.groups, **kwargs, monitor=MonitorConfig(backend="none"))
    assert opt.monitor.settings.verify
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            opt.zero_grad()
            problem.loss(i).backward()
            opt.step()
    assert 0 <= opt.monitor.latest["verify/max_rel_error"] < 1e-4


def test_verify_mode_catches_a_broken_view_and_names_the_parameter():
    register(SignSGD2, BrokenSignView())
    assert isinstance(view_for(SignSGD2), BrokenSignView)
    with pytest.warns(RuntimeWarning, match=r"verify: the update of 'fc1.weight' rebuilt from the optimizer") as rec:
        opt = train(SignSGD2, MonitorConfig(backend="none", verify=True))
    assert opt.monitor.latest["verify/max_rel_error"] > 0.1
    named = [str(w.message).split("'")[1] for w in rec if "verify" in str(w.message)]
    assert named == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # once each, over 3 steps


def test_registered_correct_view_is_used_without_clone_and_verifies():
    register(SignSGD2, SignView())
    opt = train(SignSGD2, MonitorConfig(backend="none", verify=True))
    assert isinstance(opt.monitor.view, SignView)
    assert opt.monitor.latest["verify/max_rel_error"] < 1e-6


def test_verify_off_logs_no_verify_figure():
    opt = train(torch.optim.Adam, MonitorConfig(backend="none"))
    assert "verify/max_rel_error" not in opt.monitor.latest


def test_register_rejects_bad_input():
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        register(int, SignView())
    with pytest.raises(TypeError, match="before\\(\\) and update\\(\\)"):
        register(SignSGD2, object())

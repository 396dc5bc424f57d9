"""Verify mode: the state-aware update is compared with a clone on logging steps; a broken view is
caught and named. Also the public ``register`` hook that such a view comes through."""

from __future__ import annotations

import warnings

import pytest
import torch

import models
import truth
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.capture import eager as eager_module
from monitored_optim.updates import Scaled, Stores, register, view_for
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
        # the model's unused layer
        warnings.filterwarnings("ignore", "monitored_optim. parameter 'unused", RuntimeWarning)
        for i in range(3):
            opt.zero_grad()
            problem.loss(i).backward()
            opt.step()
    assert 0 <= opt.monitor.latest["verify/max_rel_error"] < 1e-4


def test_verify_mode_catches_a_broken_view_and_names_the_parameter():
    register(SignSGD2, BrokenSignView())
    assert isinstance(view_for(SignSGD2), BrokenSignView)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        opt = train(SignSGD2, MonitorConfig(backend="none", verify=True))
    assert opt.monitor.latest["verify/max_rel_error"] > 0.1
    assert "verify: the update of 'fc1.weight' rebuilt from the optimizer" in str(rec[0].message)
    named = [str(w.message).split("'")[1] for w in rec if "verify" in str(w.message)]
    assert named == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # once each, over 3 steps


@pytest.mark.parametrize("dtype,init", [(torch.bfloat16, "normal"), (torch.float32, "ones")],
                         ids=["bf16", "constant-fp32"])
def test_verify_mode_catches_a_view_off_by_two_percent(dtype, init, monkeypatch, tmp_path):
    """A view whose update is 2% too large: hidden on bf16 (snapshotted: the figures stay exact, but
    the view's own update misses the stored change by far more than one rounding) and on a constant
    fp32 matrix (whose p_before the inversion recovers exactly from its min = max). Verify mode must
    still name it, judging against the update itself, not against eps * ||p||."""
    real = eager_module.rebuild

    def broken(*args):
        return [None if u is None else _scaled(u, 1.02) for u in real(*args)]

    monkeypatch.setattr(eager_module, "rebuild", broken)
    gen = torch.Generator().manual_seed(0)
    w = torch.ones(256, 512) if init == "ones" else 0.02 * torch.randn(256, 512, generator=gen)
    w = torch.nn.Parameter(w.to(dtype))
    opt = Monitored(torch.optim.Adam)([("w", w)], lr=1e-2, monitor=MonitorConfig(backend="none", verify=True,
                                                                                    logdir=tmp_path))
    w.grad = (1e-2 * torch.randn(w.shape, generator=gen)).to(dtype)
    before = w.detach().clone()
    with pytest.warns(RuntimeWarning, match=r"verify: the update of 'w' rebuilt"):
        opt.step()
    assert opt.monitor.latest["verify/max_rel_error"] > 0.01
    true_norm = (w.detach().double() - before.double()).norm().item()
    assert opt.monitor.latest["update_norm/w"] == pytest.approx(true_norm, rel=1e-4)  # the figure itself is exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_mode_on_weights_that_share_storage_raises_no_alarm(dtype, tmp_path):
    """Two Linear layers whose weights are one memory (``b.weight.data = a.weight.data``): the stored
    change holds both layers' updates, and each weight's figures are that change, as a clone sees it.
    Verify mode checks no single layer's rebuilt update against it: no warning, no large error."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 16).to(dtype), torch.nn.Linear(16, 16).to(dtype)
    b.weight.data = a.weight.data
    model = torch.nn.Sequential(a, torch.nn.Tanh(), b)
    named = list(model.named_parameters())
    opt = Monitored(torch.optim.Adam)(named, lr=1e-2, monitor=MonitorConfig(backend="none", verify=True,
                                                                             logdir=tmp_path))
    gen = torch.Generator().manual_seed(1)
    tol = dict(norm_rtol=1e-4) if dtype == torch.float32 else dict(norm_rtol=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=gen).to(dtype)).square().sum().backward()
            before, grads = truth.snapshot(named)
            opt.step()
            logged = opt.monitor.latest
            assert logged["verify/max_rel_error"] < 1e-3, logged["verify/max_rel_error"]  # the biases: views checked
            truth.assert_figures_match({k: v for k, v in logged.items()
                                        if not k.startswith(("verify/", "update_lost/"))},
                                       truth.figures(named, before, grads), **tol)
    assert a.weight.data_ptr() == b.weight.data_ptr()  # still one memory


def _scaled(u, k):
    if isinstance(u, Stores):
        return Stores(tuple(_scaled(d, k) for d in u.adds), u.s)
    return Scaled(u.tensor, u.factor * k) if isinstance(u, Scaled) else u * k


def test_registered_correct_view_is_used_without_clone_and_verifies():
    register(SignSGD2, SignView())
    opt = train(SignSGD2, MonitorConfig(backend="none", verify=True))
    assert isinstance(opt.monitor._engine.view, SignView)
    assert opt.monitor.latest["verify/max_rel_error"] < 1e-6


def test_verify_off_logs_no_verify_figure():
    """Without verify mode a logging step logs the clone truth's figures, and no ``verify/`` tag."""
    problem = models.mlp()
    opt = Monitored(torch.optim.Adam)(problem.groups, lr=1e-2, monitor=MonitorConfig(backend="none", every=3))
    named = list(problem.model.named_parameters())
    for i in range(3):
        opt.zero_grad()
        problem.loss(i).backward()
        before, grads = truth.snapshot(named)
        opt.step()
    assert not any(tag.startswith("verify/") for tag in opt.monitor.latest)
    truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))  # the same tags


def test_register_rejects_bad_input():
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        register(int, SignView())
    with pytest.raises(TypeError, match="before\\(\\) and update\\(\\)"):
        register(SignSGD2, object())

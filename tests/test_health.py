"""Health: frozen and missing parameters, NaN, GradScaler skips (fused and unfused), bf16 updates
lost to rounding; every figure a backend receives is finite; training equals the plain optimizer."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import models
import truth
from monitored_optim import Monitored, MonitorConfig
from test_backends import read_jsonl, read_tensorboard


def test_frozen_parameter_counts_as_no_grad(tmp_path):
    problem = models.mlp()
    problem.model["fc1"].bias.requires_grad_(False)
    opt = Monitored(torch.optim.Adam)(problem.groups, lr=1e-2, monitor=MonitorConfig(backend="none"))
    for i in range(2):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()
    latest = opt.monitor.latest
    assert latest["health/no_grad"] == 3  # fc1.bias (frozen), unused.weight, unused.bias
    assert latest["health/unchanged"] == 0 and latest["health/nonfinite"] == 0
    assert "update_to_data/fc1.bias" not in latest and "grad_norm/fc1.bias" not in latest
    assert latest["update_norm/fc1.bias"] == 0.0


def test_parameter_with_grad_that_never_changes_is_counted_and_warned_once():
    problem = models.mlp()
    groups = problem.groups
    groups[1]["lr"] = 0.0  # fc2.* get grads but never move
    opt = Monitored(torch.optim.SGD)(groups, lr=0.1, monitor=MonitorConfig(backend="none"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i in range(5):
            opt.zero_grad()
            problem.loss(i).backward()
            opt.step()
    stale = [str(w.message) for w in record if "has not changed" in str(w.message)]
    assert len(stale) == 1 and "parameter 'fc2.weight' has" in stale[0]  # one warning for both, naming both
    assert "(the same for 1 more parameter: 'fc2.bias')" in stale[0]
    assert "for 3 logging steps" in stale[0]
    assert opt.monitor.latest["health/unchanged"] == 2


@pytest.mark.parametrize("how", ["config", "watch"])
def test_parameter_left_out_of_the_optimizer_is_named(how):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)  # frozen on purpose: not reported
    params = [("0.weight", model[0].weight), ("0.bias", model[0].bias)]
    with pytest.warns(RuntimeWarning, match="'1.weight' of the watched model is in no param group"):
        if how == "config":
            opt = Monitored(torch.optim.SGD)(params, lr=0.1, monitor=MonitorConfig(backend="none", model=model))
        else:
            opt = Monitored(torch.optim.SGD)(params, lr=0.1, monitor=MonitorConfig(backend="none"))
            assert opt.monitor.watch(model) == ["1.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once only
        model(torch.ones(1, 3)).sum().backward()
        opt.step()


def test_nan_grad_is_named_counted_and_never_sent(tmp_path):
    problem = models.mlp()
    plain_problem = models.mlp()
    opt = Monitored(torch.optim.Adam)(problem.groups, lr=1e-2, monitor=MonitorConfig(
        backend="jsonl,tensorboard", logdir=tmp_path))
    plain = torch.optim.Adam(plain_problem.groups, lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            for p_, o in ((problem, opt), (plain_problem, plain)):
                o.zero_grad()
                p_.loss(i).backward()
                if i == 2:
                    p_.model["fc2"].bias.grad[0] = math.nan
                o.step()
    opt.monitor.close()
    told = [str(w.message) for w in caught if "NaN or Inf" in str(w.message)]
    assert "'fc2.bias' has NaN or Inf in its grad and update at step 3 (first" in told[0]
    assert [t.split("'")[1] for t in told] == ["fc2.bias", "fc1.weight"]  # one warning per logging step
    assert "(also non-finite parameter)" in told[1] and "the same for 2 more parameters: 'fc1.bias', 'fc2.weight'" \
        in told[1]  # each parameter named once
    for (_, a), (_, b) in zip(problem.named, plain_problem.named):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for rows in (read_jsonl(tmp_path), read_tensorboard(tmp_path)):
        assert sorted(rows) == [1, 2, 3, 4, 5]
        assert [rows[s]["health/nonfinite"] for s in (1, 2, 3, 4, 5)] == [0, 0, 1, 4, 4]  # NaN spreads
        assert all(math.isfinite(v) for row in rows.values() for v in row.values())
        assert "update_norm/fc2.bias" not in rows[3] and "update_norm/fc2.weight" in rows[3]


def amp_loop(cls, kwargs, monitor, inject_at, steps=6):
    """A CPU GradScaler loop; an inf lands in fc1.weight's grad at iteration ``inject_at``."""
    problem = models.mlp()
    opt = cls(problem.groups, **kwargs, **({"monitor": monitor} if monitor else {}))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    truths = []
    for i in range(steps):
        opt.zero_grad()
        scaler.scale(problem.loss(i)).backward()
        if i == inject_at:
            problem.model["fc1"].weight.grad[0, 0] = math.inf
        scale = scaler.get_scale()
        grads = {n: None if p.grad is None else p.grad / scale for n, p in problem.named}
        before = {n: p.detach().clone() for n, p in problem.named}
        scaler.step(opt)
        scaler.update()
        truths.append(truth.figures(problem.named, before, grads))
    return problem, opt, truths


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_grad_scaler_skips_are_not_steps_and_grads_are_unscaled(fused, tmp_path):
    kwargs = dict(lr=1e-2, fused=fused)
    plain_problem, plain, _ = amp_loop(torch.optim.AdamW, kwargs, None, inject_at=2)
    problem, opt, truths = amp_loop(Monitored(torch.optim.AdamW), kwargs,
                                    MonitorConfig(backend="jsonl", logdir=tmp_path), inject_at=2)
    opt.monitor.close()
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(problem.named, plain_problem.named))
    assert opt.monitor.step == 5 and opt.monitor.health.skipped_steps == 1
    rows = read_jsonl(tmp_path)
    assert sorted(rows) == [1, 2, 3, 4, 5]  # the skipped iteration is neither a step nor a zero update
    assert [rows[s]["health/skipped_steps"] for s in sorted(rows)] == [0, 0, 1, 1, 1]
    expected = truths[:2] + truths[3:]
    for step, want in zip(sorted(rows), expected):
        want["health/skipped_steps"] = rows[step]["health/skipped_steps"]
        truth.assert_figures_match(rows[step], want)


def bf16_layer():
    torch.manual_seed(0)
    layer = nn.Linear(512, 512, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_(0, 0.02)
    x = torch.randn(64, 512, dtype=torch.bfloat16)
    y = torch.randn(64, 512, dtype=torch.bfloat16)
    return layer, x, y


def test_bf16_updates_lost_to_rounding_match_the_clone_truth():
    layer, x, y = bf16_layer()
    opt = Monitored(torch.optim.Adam)(layer.named_parameters(), lr=1e-4, monitor=MonitorConfig(backend="none"))
    lost_at = {}
    for step in range(1, 101):
        opt.zero_grad()
        (layer(x) - y).float().pow(2).mean().backward()
        before = layer.weight.detach().clone()
        opt.step()
        u = layer.weight.detach().float() - before.float()
        lost = (u == 0).float().mean().item()
        ratio = math.log10(u.double().std().item() / before.double().std().item())
        latest = opt.monitor.latest
        assert latest["update_lost/weight"] == pytest.approx(lost, abs=0.02), step
        assert latest["update_to_data/weight"] == pytest.approx(ratio, abs=0.01), step
        lost_at[step] = lost
    assert 0.10 < lost_at[1] < 0.14 and lost_at[100] > 2 * lost_at[1]  # shared/reference §3: 11.8% at step 1


def test_fp32_has_no_update_lost_tag():
    """An fp32 model logs the clone truth's figures and no ``update_lost/`` tag (nothing rounds away)."""
    problem = models.mlp()
    opt = Monitored(torch.optim.Adam)(problem.groups, lr=1e-2, monitor=MonitorConfig(backend="none"))
    named = list(problem.model.named_parameters())
    problem.loss(0).backward()
    before, grads = truth.snapshot(named)
    opt.step()
    assert not any(tag.startswith("update_lost/") for tag in opt.monitor.latest)
    truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))  # the same tags


def test_an_empty_parameter_is_never_counted_as_unchanged(tmp_path):
    """A 0-element parameter (a layer of width 0) has a grad of 0 elements and nothing to change:
    it is neither counted in ``health/unchanged`` nor warned about."""
    empty, w = torch.nn.Parameter(torch.zeros(0, 5)), torch.nn.Parameter(torch.ones(4, 4))
    opt = Monitored(torch.optim.SGD)([("empty", empty), ("w", w)], lr=0.1,
                                     monitor=MonitorConfig(backend="none", logdir=tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            empty.grad, w.grad = torch.zeros(0, 5), torch.ones(4, 4)
            opt.step()
    assert opt.monitor.latest["health/unchanged"] == 0
    assert not [w for w in caught if "has not changed" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_radam_schedule_free_silent_steps_are_no_false_alarm(dtype):
    """RAdamScheduleFree leaves every weight as it is on its first four steps by design (its silent
    warm-up, lr·rect with rect = 0): no parameter is counted unchanged, none warned about, no bf16
    update counted lost; once it moves (step 5 on) the figures are as usual. A group whose lr the user
    set to 0 is still warned about."""
    cls = pytest.importorskip("schedulefree").RAdamScheduleFree
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(dtype)
    frozen = nn.Linear(8, 8).to(dtype)
    groups = [{"params": list(model.named_parameters())},
              {"params": [("frozen." + n, p) for n, p in frozen.named_parameters()], "lr": 0.0}]
    opt = Monitored(cls)(groups, lr=1e-3, monitor=MonitorConfig(backend="none"))
    opt.train()
    x = torch.randn(16, 32, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 7):
            opt.zero_grad()
            (model(x).square().mean() + frozen(model(x)).square().mean()).backward()
            opt.step()
            latest = opt.monitor.latest
            assert latest["health/unchanged"] == 2, step  # the user's lr=0 group only
            if step <= 4:
                assert all(v == 0 for k, v in latest.items() if k.startswith("update_lost/") and "frozen" not in k)
    stale = [str(w.message) for w in caught if "has not changed" in str(w.message)]
    assert len(stale) == 1 and "'frozen.weight'" in stale[0] and "'0.weight'" not in stale[0], stale

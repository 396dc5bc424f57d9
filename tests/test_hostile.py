"""Hostile but plausible inputs: each once crashed step(), corrupted figures or gave an unclear error.
Every case checks the trajectory against the plain optimizer and the figures against a clone."""

from __future__ import annotations

import gc
import math
import pickle
import warnings
import weakref

import pytest
import torch
from torch import nn

import truth
from monitored_optim import Monitored, MonitorConfig

QUIET = MonitorConfig(backend="none")


def logged_and_truth(cls, kwargs, make_params, set_grads, steps=3):
    """Plain and monitored side by side: (logged figures, clone truth) per step of the monitored
    run, after checking that both trajectories are bitwise equal."""
    runs = []
    for build in (cls, Monitored(cls)):
        named = make_params()
        opt = build(named, **kwargs, **({"monitor": QUIET} if build is not cls else {}))
        seen = []
        for i in range(steps):
            set_grads(named, i)
            before, grads = truth.snapshot(named)
            opt.step()
            seen.append((dict(opt.monitor.latest) if build is not cls else None,
                         truth.figures(named, before, grads)))
        runs.append((named, seen))
    (plain_named, _), (named, seen) = runs
    for (_, a), (_, b) in zip(plain_named, named):
        assert torch.equal(a, b)
    return seen


def test_sparse_grads_with_sgd_momentum():
    def params():
        torch.manual_seed(0)
        return list(nn.Embedding(50, 4, sparse=True).named_parameters())

    def grads(named, i):
        (_, w), = named
        w.grad = torch.sparse_coo_tensor(torch.tensor([[1, 2, 2 + i]]), torch.ones(3, 4), (50, 4))

    logged, expected = logged_and_truth(torch.optim.SGD, dict(lr=0.1, momentum=0.9), params, grads, steps=2)[-1]
    truth.assert_figures_match(logged, expected)


def test_empty_parameter_does_not_poison_the_figures():
    def params():
        torch.manual_seed(0)
        return [("w", nn.Parameter(torch.randn(4, 3))), ("e", nn.Parameter(torch.zeros(0, 3)))]

    def grads(named, i):
        for _, p in named:
            p.grad = torch.ones_like(p)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        latest, _ = logged_and_truth(torch.optim.SGD, dict(lr=0.1), params, grads, steps=2)[-1]
    assert latest["health/nonfinite"] == 0 and "global/update_norm" in latest
    assert latest["update_norm/e"] == 0.0 and "update_to_data/e" not in latest


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
@pytest.mark.parametrize("wd", [10.0, 10.0 + 1e-5])
def test_weight_decay_with_lr_times_wd_near_one(cls, wd):
    def params():
        torch.manual_seed(0)
        return [("w", nn.Parameter(torch.randn(6, 5)))]

    def grads(named, i):
        torch.manual_seed(10 + i)
        named[0][1].grad = torch.randn(6, 5)

    logged, expected = logged_and_truth(cls, dict(lr=0.1, weight_decay=wd), params, grads, steps=2)[-1]
    truth.assert_figures_match(logged, expected)


def test_group_without_numeric_lr_and_integer_parameters():
    class NoLr(torch.optim.SGD):
        pass

    w = nn.Parameter(torch.randn(3, 3))
    q = nn.Parameter(torch.ones(3, dtype=torch.int8), requires_grad=False)
    opt = Monitored(NoLr)([("w", w), ("q", q)], lr=0.1, monitor=QUIET)
    opt.param_groups[0]["lr_hidden"] = opt.param_groups[0]["lr"]
    w.grad = torch.ones(3, 3)
    opt.step()
    opt.param_groups[0]["lr"] = None  # as transformers' Adafactor(lr=None) stores it
    with pytest.raises(TypeError):
        opt.step()  # SGD itself cannot step with lr=None ...
    assert "param_norm/q" not in opt.monitor.latest and "update_norm/w" in opt.monitor.latest
    from monitored_optim.figures import group_lrs, learning_rates
    # ... but the figures skip it instead of failing
    assert group_lrs(opt.param_groups, {}) == [None] and learning_rates(opt, group_lrs(opt.param_groups, {})) == {}


def test_callable_positional_argument_that_is_not_a_closure():
    class ModelAwareSGD(torch.optim.SGD):
        def step(self, model):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)

    model = nn.Linear(3, 2)
    opt = Monitored(ModelAwareSGD)(model.named_parameters(), lr=0.1, monitor=QUIET)
    model(torch.ones(1, 3)).sum().backward()
    opt.step(model)
    assert opt.monitor.latest["update_norm/weight"] > 0


def test_third_party_init_that_calls_state_dict_and_subclass_of_monitored():
    class Warmstart(torch.optim.Adam):
        def __init__(self, params, **kw):
            super().__init__(params, **kw)
            self.initial = self.state_dict()

    opt = Monitored(Warmstart)(nn.Linear(2, 2).named_parameters(), monitor=QUIET)
    assert "monitor" not in opt.initial and opt.state_dict()["monitor"] == {"step": 0}

    class MyAdamW(Monitored(torch.optim.AdamW)):
        pass

    assert Monitored(MyAdamW) is MyAdamW


def test_bf16_under_decoupled_weight_decay_reports_the_effective_update():
    def params():
        torch.manual_seed(0)
        return [("w", nn.Parameter(torch.randn(256, 64).to(torch.bfloat16)))]

    def grads(named, i):
        torch.manual_seed(i)
        named[0][1].grad = torch.randn(256, 64).to(torch.bfloat16)

    latest, expected = logged_and_truth(torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1), params, grads,
                                        steps=2)[-1]
    assert latest["update_to_data/w"] == pytest.approx(expected["update_to_data/w"], abs=0.01)
    assert latest["update_norm/w"] == pytest.approx(expected["update_norm/w"], rel=1e-3)


def test_duplicate_names_across_groups_stay_apart():
    gen, disc = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = Monitored(torch.optim.SGD)([{"params": gen.named_parameters(), "lr": 0.01},
                                      {"params": disc.named_parameters(), "lr": 0.5}], monitor=QUIET)
    for m in (gen, disc):
        m(torch.ones(1, 2)).sum().backward()
    opt.step()
    latest = opt.monitor.latest
    assert {"update_norm/weight", "update_norm/weight@group1", "update_norm/bias@group1"} <= set(latest)
    assert latest["update_norm/weight"] == pytest.approx(0.01 * math.sqrt(4), rel=1e-6)
    assert latest["update_norm/weight@group1"] == pytest.approx(0.5 * math.sqrt(4), rel=1e-6)


def test_duplicate_names_within_a_group_stay_apart():
    """Two parameters one group names alike (torch accepts it): each keeps its own figures and counts
    in health, the second under ``@group0``."""
    a, b = nn.Parameter(torch.ones(4, 4)), nn.Parameter(torch.ones(4, 4))
    opt = Monitored(torch.optim.SGD)([("w", a), ("w", b)], lr=0.1, monitor=QUIET)
    a.grad, b.grad = torch.full((4, 4), 1.0), torch.full((4, 4), math.nan)
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        opt.step()
    latest = opt.monitor.latest
    assert latest["update_norm/w"] == pytest.approx(0.1 * 4, rel=1e-6)
    assert "update_norm/w@group0" not in latest  # b's update is NaN: counted, not sent
    assert latest["grad_norm/w"] == pytest.approx(4.0) and latest["health/nonfinite"] == 1.0
    b.grad = torch.full((4, 4), 2.0)
    a.grad = torch.full((4, 4), math.nan)
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        opt.step()
    assert opt.monitor.latest["grad_norm/w@group0"] == pytest.approx(8.0) and "grad_norm/w" not in opt.monitor.latest


def test_an_empty_view_of_a_buffer_aliases_nothing(tmp_path):
    """A 0-element Parameter over the end of another's storage shares no element with it: the large one
    keeps its view (no clone), as it would alone."""
    buf = torch.randn(100, 100)
    named = [("w", nn.Parameter(buf)), ("tail", nn.Parameter(buf[100:]))]
    opt = Monitored(torch.optim.AdamW)(named, lr=1e-3, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    assert "aliased" not in opt.monitor.describe()
    named[0][1].grad = torch.randn(100, 100)
    before, grads = truth.snapshot(named[:1])
    opt.step()
    truth.assert_figures_match({k: v for k, v in opt.monitor.latest.items() if "tail" not in k},
                               {**truth.figures(named[:1], before, grads), "health/no_grad": 1.0})


def test_unpickling_with_a_config_that_no_longer_works_warns_instead_of_failing(tmp_path, monkeypatch):
    opt = Monitored(torch.optim.SGD)(nn.Linear(2, 2).named_parameters(), lr=0.1)  # from the environment
    blob = pickle.dumps(opt)
    monkeypatch.setenv("MONITORED_OPTIM_EVERY", "ten")
    with pytest.warns(RuntimeWarning, match="does not work here"):
        loaded = pickle.loads(blob)
    assert loaded.monitor.settings.backends == ()


@pytest.mark.parametrize("field,value", [("logdir", 5), ("logdir", b"runs"), ("model", "x")])
def test_bad_config_types_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"MonitorConfig.{field}="):
        Monitored(torch.optim.SGD)(nn.Linear(2, 2).named_parameters(), lr=0.1,
                                   monitor=MonitorConfig(**{field: value}))


def test_name_clashes_with_monitor_are_explained():
    class OwnMonitorArg(torch.optim.SGD):
        def __init__(self, params, lr=0.1, monitor=None):
            super().__init__(params, lr=lr)

    with pytest.raises(TypeError, match="already takes a 'monitor' argument"):
        Monitored(OwnMonitorArg)

    class SetsMonitor(torch.optim.SGD):
        def __init__(self, params, lr=0.1):
            super().__init__(params, lr=lr)
            self.monitor = "mine"

    with pytest.raises(AttributeError, match="sets its own 'monitor' attribute"):
        Monitored(SetsMonitor)(nn.Linear(2, 2).named_parameters(), monitor=MonitorConfig(backend="none"))


@pytest.mark.parametrize("kwargs", [dict(), dict(foreach=False), dict(fused=True), dict(lr=torch.tensor(0.0))],
                         ids=["foreach", "single", "fused", "tensor-lr"])
def test_adamw_at_lr_zero_logs_a_zero_update(kwargs):
    """The first step of a linear warmup: lr = 0 with weight decay leaves p unchanged; the batched
    rebuild must not divide by its zero step size."""
    def params():
        torch.manual_seed(0)
        return [("w", nn.Parameter(torch.randn(4, 3))), ("b", nn.Parameter(torch.randn(3)))]

    def grads(named, i):
        for _, p in named:
            p.grad = torch.randn_like(p)

    for logged, expected in logged_and_truth(torch.optim.AdamW, {"lr": 0.0, "weight_decay": 0.1, **kwargs},
                                             params, grads, steps=2):
        truth.assert_figures_match(logged, expected)
        assert logged["update_norm/w"] == 0.0 and logged["health/nonfinite"] == 0


def _assert_true_or_absent(logged, expected):
    """Every ratio logged equals the truth; one may be missing (not wrong) on the step where its
    tensor first becomes mean-dominated; norms and health always match."""
    for tag, want in expected.items():
        if "_to_data/" in tag and tag not in logged:
            continue
        assert tag in logged, tag
        if "_to_data/" in tag:
            assert abs(logged[tag] - want) <= 2e-3, (tag, logged[tag], want)
        elif not tag.startswith("health/"):
            assert logged[tag] == pytest.approx(want, rel=1e-4), tag
    assert not set(logged) - set(expected) - {t for t in logged if t.startswith(("lr/", "monitor/"))
                                              or t == "health/spikes"}


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.SGD, dict(lr=0.1)), (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                        (torch.optim.Adam, dict(lr=1e-2)), (torch.optim.AdamW, dict(lr=1e-2))])
@pytest.mark.parametrize("noise", [1e-4, 3e-3])
def test_a_tensor_that_becomes_mean_dominated_never_logs_a_wrong_ratio(cls, kwargs, noise):
    """A grad that is randn at step 1 and 1 + noise * randn after: the uncentred sums chosen from
    step 1 cannot give its spread at step 2, so that ratio is left out rather than wrong; from step 3
    it is centred and logged. A zero-initialised bias with one-sign grads: zero spread at step 1,
    centred from step 2."""
    def params():
        torch.manual_seed(0)
        return [("w", nn.Parameter(torch.randn(64, 64))), ("b", nn.Parameter(torch.zeros(64)))]

    def grads(named, i):
        (_, w), (_, b) = named
        w.grad = torch.randn_like(w) if i == 0 else 1 + noise * torch.randn_like(w)
        b.grad = 1 + 0.01 * torch.rand_like(b)

    seen = logged_and_truth(cls, kwargs, params, grads, steps=4)
    for logged, expected in seen:
        _assert_true_or_absent(logged, expected)
    for logged, _ in seen[2:]:
        assert "grad_to_data/w" in logged and "update_to_data/b" in logged


def test_norms_of_a_large_float32_parameter_are_accurate():
    """torch's float32 vector norm on a CPU accumulates in float32: -7.5e-4 relative on 2^24
    elements. The figures take it per row of 4096 and combine the rows in float64."""
    def params():
        torch.manual_seed(0)
        return [("w", nn.Parameter(0.02 * torch.randn(1 << 24)))]

    def grads(named, i):
        (_, w), = named
        w.grad = torch.randn_like(w)

    for logged, expected in logged_and_truth(torch.optim.Adam, dict(lr=1e-3), params, grads, steps=1):
        truth.assert_figures_match(logged, expected, norm_rtol=1e-5)


def test_a_one_element_step_tensor_next_to_scalar_ones():
    """A hand-converted checkpoint whose ``state['step']`` has shape (1,) for one parameter."""
    torch.manual_seed(0)
    named = [("a", nn.Parameter(torch.randn(3))), ("b", nn.Parameter(torch.randn(3)))]
    opt = Monitored(torch.optim.Adam)(named, lr=1e-2, monitor=QUIET)
    for _ in range(3):
        for _, p in named:
            p.grad = torch.randn_like(p)
        before, grads = truth.snapshot(named)
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))
        opt.state[named[0][1]]["step"] = opt.state[named[0][1]]["step"].reshape(1)


@pytest.mark.parametrize("cls,kwargs,dtype", [
    (torch.optim.SGD, dict(lr=torch.tensor([0.1]), weight_decay=0.1), torch.float32),
    (torch.optim.Adam, dict(lr=torch.tensor([1e-2]), foreach=False), torch.bfloat16),
    (torch.optim.AdamW, dict(lr=torch.tensor([1e-2]), foreach=False), torch.float32),
], ids=["sgd", "adam-bf16", "adamw"])
def test_zero_dim_parameter_with_a_one_element_tensor_lr(cls, kwargs, dtype):
    """A 0-dim parameter (CLIP's logit_scale) under a Tensor lr of shape (1,)."""
    def params():
        return [("logit_scale", nn.Parameter(torch.tensor(2.6, dtype=dtype)))]

    def grads(named, i):
        named[0][1].grad = torch.tensor(0.3 + 0.1 * i, dtype=dtype)

    for logged, expected in logged_and_truth(cls, kwargs, params, grads, steps=2):
        assert logged["update_norm/logit_scale"] == pytest.approx(expected["update_norm/logit_scale"], rel=1e-2)


@pytest.mark.parametrize("foreach", [False, True])
def test_adafactor_on_a_large_transposed_matrix_with_a_contiguous_grad(foreach):
    """A non-contiguous parameter of more than ``PART_ELEMENTS`` elements whose grad was set as a
    contiguous tensor: the row-block rebuild would cut the parameter flat (it once raised a view
    error); it takes the whole-matrix rebuild instead."""
    def params():
        torch.manual_seed(0)
        return [("w", nn.Parameter(torch.randn(700, 500).t()))]

    def grads(named, i):
        (_, w), = named
        w.grad = torch.randn(500, 700, generator=torch.Generator().manual_seed(i))

    for logged, expected in logged_and_truth(torch.optim.Adafactor, dict(lr=1e-2, foreach=foreach), params, grads):
        truth.assert_figures_match(logged, expected)


@pytest.mark.parametrize("shape", [(64, 80), (600, 512)], ids=["whole", "row-blocks"])
@pytest.mark.parametrize("bad", ["param", "grad"])
def test_adafactor_with_a_nan_element_rebuilds_the_finite_updates_of_the_others(shape, bad):
    """Adafactor's step takes α = max(eps2, RMS(p)) and the clipping's max(1, RMS(U)/d) with Python's
    ``max``, which gives the floor for NaN: one NaN in p leaves the other elements' updates finite.
    Rebuilt by the view, the update histogram holds every finite element of the clone truth's u,
    with its extremes (and none where a NaN grad made every update NaN); the trajectory is the plain
    optimizer's bit for bit."""
    from test_histograms import assert_exact, truth as hist_truth

    torch.manual_seed(0)
    w0 = torch.randn(*shape) * 0.02
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    (w0 if bad == "param" else g)[3, 7] = math.nan
    w, plain = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt = Monitored(torch.optim.Adafactor)([("w", w)], lr=1e-2, monitor=MonitorConfig(
        backend="none", every=1, figures="histograms"))
    reference = torch.optim.Adafactor([plain], lr=1e-2)
    for _ in range(2):
        w.grad, plain.grad = g.clone(), g.clone()
        before = w.detach().clone()
        opt.step()
        reference.step()
        assert torch.equal(w.detach().view(torch.int32), plain.detach().view(torch.int32))
        u = w.detach().double() - before.double()
        if bad == "param":  # a NaN grad reaches every element through the factored second moment
            assert u.isfinite().sum() == w.numel() - 1
        assert_exact(opt.monitor.histograms["update_hist/w"], hist_truth(u), spacing=float(
            torch.finfo(torch.float32).eps * before.nan_to_num().abs().max()))


@pytest.mark.parametrize("params", [None, "fc*"])
def test_a_dropped_model_and_optimizer_leave_nothing_alive(params):
    """The parameter selection holds no parameter (a cache keyed by tensors would keep every model of
    a sweep alive): once the model and its monitored optimizer are dropped, their weights are freed."""
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(4, 4))
    opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=0.1,
                                     monitor=MonitorConfig(backend="none", params=params))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    weight = weakref.ref(model.fc1.weight)
    del model, opt
    gc.collect()
    assert weight() is None

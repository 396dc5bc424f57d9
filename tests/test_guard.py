"""The guard, alerts and stopping (``MonitorConfig(guard=, alerts=, stop_on=, skip_budget=)``).

A step the guard skips is checked against a twin run of the plain optimizer that does not call
``step()`` at that step: parameters and every state tensor bit for bit. Alerts are read from the
``monitored_optim.alerts`` logger and from W&B's own ``run.alert`` in offline mode.
"""

from __future__ import annotations

import copy
import logging
import math
import pickle

import pytest
import torch
from torch import nn

from monitored_optim import Monitored, MonitorConfig
from monitored_optim.families.spikes import MIN_HISTORY

POISONS = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}


class Stepped(torch.optim.SGD):
    """A user subclass overriding ``step``: the clone route."""

    def step(self, closure=None):
        return super().step(closure)


OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    "SGD-nesterov": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5)),
    "NAdam": (torch.optim.NAdam, dict(lr=1e-3)),
    "Adam-view-warmup": (torch.optim.Adam, dict(lr=1e-7)),
    "clone-route": (Stepped, dict(lr=1e-2, momentum=0.9)),
}


def net(dtype=torch.float32) -> nn.Module:
    """A small model with a LayerNorm at 1.0 and biases at 0, as real models start."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.bias.zero_()
    return model


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, 6, generator=gen).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


def assert_same(a: nn.Module, opt_a: torch.optim.Optimizer, b: nn.Module, opt_b: torch.optim.Optimizer) -> None:
    """Parameters, every state tensor and the state dicts' states bit for bit."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for key in sa[k]:
            assert _equal(sa[k][key], sb[k][key]), (k, key)


def _equal(a, b) -> bool:
    """Bit for bit: tensors, lists of them (LBFGS's history), numbers."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def closure_of(model: nn.Module, opt: torch.optim.Optimizer, step: int, poison: float | None):
    """The closure of ``step``: zero the grads, the loss, its grads, ``poison`` put into one element."""
    def closure():
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        if poison is not None:
            model[0].weight.grad[1, 2] = poison
        return loss
    return closure


def twin_run(cls, kwargs, poisoned: dict[int, float], steps: int, closure: bool = False, dtype=torch.float32,
             **config):
    """Train a monitored optimizer with the guard and its plain twin, which does not call ``step()`` at
    the ``poisoned`` steps (step -> the value put into one grad element there)."""
    model, twin = net(dtype), net(dtype)
    opt = Monitored(cls)(model.named_parameters(), **kwargs,
                         monitor=MonitorConfig(**{"backend": "none", "every": 2, "guard": "nonfinite", **config}))
    plain = cls(twin.parameters(), **kwargs)
    skipped = []
    for step in range(1, steps + 1):
        poison = poisoned.get(step)
        fn = closure_of(model, opt, step, poison)
        if closure:
            out = opt.step(fn)
            assert out is not None and torch.isfinite(out)
        else:
            fn()
            opt.step()
        skipped.append(opt.monitor.step_was_skipped)
        if poison is None and closure:
            plain.step(closure_of(twin, plain, step, None))
        elif poison is None:
            closure_of(twin, plain, step, None)()
            plain.step()
    return model, opt, twin, plain, skipped


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_skipped_step_leaves_parameters_and_state_as_the_twin_that_never_took_it(name, poison):
    cls, kwargs = OPTIMIZERS[name]
    poisoned = {1: POISONS[poison], 4: POISONS[poison], 5: POISONS[poison]}  # the first, and a logging step
    model, opt, twin, plain, skipped = twin_run(cls, kwargs, poisoned, 8)
    assert skipped == [s in poisoned for s in range(1, 9)]
    assert_same(model, opt, twin, plain)
    assert opt.monitor.step == 5  # 8 calls, 3 skipped: the updates
    assert opt.monitor.latest["guard/skipped"] == 3.0
    assert all(math.isfinite(p.abs().max().item()) for p in model.parameters())


@pytest.mark.parametrize("name", ["SGD-nesterov", "AdamW"])
def test_with_a_closure_the_closure_runs_then_the_decision_and_step_returns_its_loss(name):
    cls, kwargs = OPTIMIZERS[name]
    poisoned = {3: math.nan, 4: math.inf}
    model, opt, twin, plain, skipped = twin_run(cls, kwargs, poisoned, 6, closure=True)
    assert skipped == [False, False, True, True, False, False]
    assert_same(model, opt, twin, plain)


def test_lbfgs_closure_called_again_inside_the_step_runs_the_closure():
    model, opt, twin, plain, skipped = twin_run(torch.optim.LBFGS, dict(lr=0.1, max_iter=3), {2: math.nan}, 4,
                                                closure=True)
    assert skipped == [False, True, False, False]
    assert_same(model, opt, twin, plain)


def test_bf16_parameters():
    model, opt, twin, plain, skipped = twin_run(torch.optim.AdamW, dict(lr=1e-3), {3: math.inf}, 6,
                                                dtype=torch.bfloat16)
    assert skipped == [False, False, True, False, False, False]
    assert_same(model, opt, twin, plain)


def test_a_healthy_run_with_the_guard_is_the_plain_run_bit_for_bit():
    model, opt, twin, plain, skipped = twin_run(torch.optim.AdamW, dict(lr=1e-2), {}, 60, guard="nonfinite,spikes")
    assert not any(skipped)
    assert_same(model, opt, twin, plain)
    assert opt.monitor.latest["guard/skipped"] == 0.0


def _spiky(steps: int, spike_at: int, guard: str, **config):
    model, twin = net(), net()
    opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3,
                                       monitor=MonitorConfig(backend="none", every=5, guard=guard, **config))
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    skipped = []
    for step in range(1, steps + 1):
        for m, o in ((model, opt), (twin, plain)):
            o.zero_grad()
            loss_of(m, step).backward()
            if step == spike_at:
                m[3].weight.grad.mul_(1e4)
        opt.step()
        skipped.append(opt.monitor.step_was_skipped)
        if step != spike_at:
            plain.step()
    return model, opt, twin, plain, skipped


def test_a_1e4_grad_on_one_layer_is_skipped_by_spikes_and_nothing_else():
    model, opt, twin, plain, skipped = _spiky(30, 17, "nonfinite,spikes")
    assert [i + 1 for i, s in enumerate(skipped) if s] == [17]
    assert_same(model, opt, twin, plain)


def test_nonfinite_alone_lets_a_spike_through():
    _, _, _, _, skipped = _spiky(20, 17, "nonfinite")
    assert not any(skipped)


def test_nothing_is_skipped_before_the_history_holds_enough_values():
    _, _, _, _, skipped = _spiky(MIN_HISTORY + 2, MIN_HISTORY, "nonfinite,spikes")
    assert not any(skipped)


def test_a_restored_monitor_keeps_its_guards_history():
    """A spike right after a restore is skipped: the history came with the state dict (and the pickle)."""
    model = net()
    opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3,
                                       monitor=MonitorConfig(backend="none", every=5, guard="nonfinite,spikes"))
    for step in range(1, 11):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
    saved = opt.state_dict()
    pickled = pickle.loads(pickle.dumps(opt))
    for restored_kind in ("state_dict", "pickle", "fresh"):
        m = copy.deepcopy(model)
        if restored_kind == "pickle":
            new = pickled
            new.param_groups[0]["params"] = list(m.parameters())  # the pickled optimizer's own tensors
            m = None
        else:
            new = Monitored(torch.optim.AdamW)(m.named_parameters(), lr=1e-3,
                                               monitor=MonitorConfig(backend="none", every=5,
                                                                     guard="nonfinite,spikes"))
            if restored_kind == "state_dict":
                new.load_state_dict(saved)
        params = new.param_groups[0]["params"]
        new.zero_grad()
        for p in params:
            p.grad = torch.randn_like(p) * 1e-2
        params[2].grad.mul_(1e5)  # the LayerNorm's weight
        new.step()
        assert new.monitor.step_was_skipped == (restored_kind != "fresh"), restored_kind
        if restored_kind != "fresh":
            assert new.monitor._guard.skipped == 1
            assert new.monitor.step == 10


def test_amp_skips_are_not_counted_twice():
    """A step GradScaler skips never reaches the guard: health/skipped_steps counts it, guard/skipped not."""
    model = net()
    opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=1e-2,
                                     monitor=MonitorConfig(backend="none", every=1, guard="nonfinite"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(1, 5):
        opt.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step == 2:
            model[0].weight.grad[0, 0] = math.inf
        scaler.step(opt)
        scaler.update()
    assert opt.monitor.latest["guard/skipped"] == 0.0
    assert opt.monitor.latest["health/skipped_steps"] == 1.0


# ----- alerts and stopping -----------------------------------------------------------------------

def _nan_run(steps: int, nan_from: int, clock=None, **config):
    """A run whose weights turn NaN at step ``nan_from`` (without the guard they stay NaN); ``clock``:
    the alerts' clock."""
    model = net()
    opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=1e-2,
                                     monitor=MonitorConfig(**{"backend": "none", "every": 1, **config}))
    if clock is not None:
        opt.monitor._voice.clock = clock
    stops = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss_of(model, step).backward()
        if step >= nan_from:
            model[0].weight.grad[0, 0] = math.nan
        opt.step()
        stops.append(opt.monitor.should_stop)
    return opt, stops


def alerts_in(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "monitored_optim.alerts"]


def test_a_lasting_nan_is_one_alert_on_the_logger_and_none_before_it(caplog):
    caplog.set_level(logging.WARNING, logger="monitored_optim.alerts")
    _nan_run(9, 10, alerts="nonfinite")
    assert not alerts_in(caplog)  # none before the event
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        _nan_run(45, 10, alerts="nonfinite")
    records = alerts_in(caplog)
    assert len(records) == 1  # 36 steps of NaN: one alert
    assert records[0].levelno == logging.ERROR
    assert "nonfinite at step 10" in records[0].getMessage() and "0.weight" in records[0].getMessage()


def test_no_alert_when_none_is_asked(caplog):
    caplog.set_level(logging.DEBUG, logger="monitored_optim.alerts")
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        _nan_run(20, 5)
    assert not alerts_in(caplog)


def test_a_later_alert_says_how_many_were_held_back(caplog):
    ticks = iter(range(0, 10_000, 100))  # 100 s a step: the interval passes every 6 steps
    caplog.set_level(logging.WARNING, logger="monitored_optim.alerts")
    _nan_run(14, 3, clock=lambda: float(next(ticks)), alerts="skipped", guard="nonfinite", skip_budget=100,
             count="calls")
    records = alerts_in(caplog)
    assert len(records) == 2
    assert "skipped at step 3" in records[0].getMessage() and "held back" not in records[0].getMessage()
    second = records[1].getMessage()
    assert "skipped at step 9" in second and "(5 more skipped alerts held back" in second


def test_should_stop_without_the_guard_on_a_nonfinite_figure():
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        opt, stops = _nan_run(8, 5, stop_on="nonfinite")
    assert stops == [False] * 4 + [True] * 4
    assert opt.monitor._voice.stop_reason == "nonfinite at step 5"


def test_the_guard_past_its_budget_stops_with_finite_weights(caplog):
    caplog.set_level(logging.WARNING, logger="monitored_optim.alerts")
    opt, stops = _nan_run(12, 5, guard="nonfinite", skip_budget=3, alerts="stalled")
    assert stops == [False] * 7 + [True] * 5  # steps 5, 6, 7 skipped within the budget, the 4th asks to stop
    assert all(torch.isfinite(p).all() for g in opt.param_groups for p in g["params"])
    records = alerts_in(caplog)
    assert len(records) == 1 and records[0].levelno == logging.ERROR and "stalled" in records[0].getMessage()


def test_a_user_sink_with_alert_gets_the_alerts():
    class Sink:
        def __init__(self):
            self.alerts, self.rows = [], 0

        def log(self, metrics, step):
            self.rows += 1

        def alert(self, title, text, level):
            self.alerts.append((title, text, level))

    sink = Sink()
    _nan_run(6, 3, backend=[sink], guard="nonfinite", alerts="skipped")
    assert sink.alerts == [("monitored_optim: skipped at step 3", "the guard skipped a step: 0.weight (grad)",
                            logging.WARNING)]
    assert sink.rows == 2  # steps 1 and 2 logged; 3 to 6 skipped


def test_a_failing_alert_destination_warns_once_and_training_goes_on():
    class Broken:
        def __init__(self):
            self.rows = 0

        def log(self, metrics, step):
            self.rows += 1

        def alert(self, title, text, level):
            raise ConnectionError("no route to the pager")

    sink = Broken()
    with pytest.warns(RuntimeWarning, match="alerts failed and are disabled.*no route to the pager") as told:
        _nan_run(8, 3, backend=[sink], guard="nonfinite", skip_budget=1, alerts="skipped,stalled")
    assert len([w for w in told if "alerts failed" in str(w.message)]) == 1


def test_wandb_run_alert_in_offline_mode(monkeypatch, tmp_path):
    """W&B's own ``run.alert`` is called with a title of at most 64 characters (spied, then run)."""
    import wandb
    from wandb.sdk.wandb_run import Run

    calls = []
    real = Run.alert

    def spy(self, title, text, level=None, wait_duration=None):
        calls.append((title, text, level))
        return real(self, title=title, text=text, level=level, wait_duration=wait_duration)

    monkeypatch.setattr(Run, "alert", spy)
    opt, _ = _nan_run(6, 4, backend="wandb", guard="nonfinite", alerts="skipped,nonfinite")
    opt.monitor.close()
    assert [(t, str(level)) for t, _, level in calls] == [
        ("monitored_optim: skipped at step 4", str(wandb.AlertLevel.WARN)),
        ("monitored_optim: nonfinite at step 4", str(wandb.AlertLevel.ERROR))]
    assert all(len(t) <= 64 for t, _, _ in calls)


# ----- bad settings ------------------------------------------------------------------------------

@pytest.mark.parametrize("config, match", [
    (dict(guard="nonfinte"), r"MonitorConfig.guard='nonfinte' is not valid \('nonfinte' is unknown \(did you mean "
                             r"'nonfinite'\?\)\): expected 'none' or some of nonfinite, spikes"),
    (dict(alerts="spike"), r"'spike' is unknown \(did you mean 'spikes'\?\)"),
    (dict(stop_on="skipped"), r"MonitorConfig.stop_on asks for 'skipped'.*needs MonitorConfig.guard"),
    (dict(alerts="spikes", figures="norms"), r"needs the 'spikes' figures or guard='spikes'"),
    (dict(skip_budget=0), r"skip_budget=0 is not a valid skip budget"),
    (dict(guard=1), r"MonitorConfig.guard=1 is not valid \(int\)"),
    (dict(guard=["nonfinite", 1]), r"MonitorConfig.guard=\['nonfinite', 1\] is not valid: expected .* as names"),
    (dict(skip_budget=3), r"skip_budget=3 has no effect without the guard"),
])
def test_bad_settings_fail_at_construction_naming_the_accepted_values(config, match):
    model = net()
    with pytest.raises(ValueError, match=match):
        Monitored(torch.optim.SGD)(model.parameters(), lr=0.1, monitor=MonitorConfig(backend="none", **config))


def test_the_environment_sets_them(monkeypatch):
    monkeypatch.setenv("MONITORED_OPTIM_GUARD", "nonfinite,spikes")
    monkeypatch.setenv("MONITORED_OPTIM_SKIP_BUDGET", "2")
    monkeypatch.setenv("MONITORED_OPTIM_ALERTS", "all")
    monkeypatch.setenv("MONITORED_OPTIM_STOP_ON", "stalled")
    opt = Monitored(torch.optim.SGD)(net().named_parameters(), lr=0.1, monitor=MonitorConfig(backend="none"))
    s = opt.monitor.settings
    assert (s.guard, s.skip_budget, s.stop_on) == ({"nonfinite", "spikes"}, 2, {"stalled"})
    assert s.alerts == {"nonfinite", "spikes", "skipped", "stalled", "unchanged", "no_grad"}
    monkeypatch.setenv("MONITORED_OPTIM_GUARD", "nan")
    with pytest.raises(ValueError, match="MONITORED_OPTIM_GUARD='nan' is not valid"):
        Monitored(torch.optim.SGD)(net().named_parameters(), lr=0.1, monitor=MonitorConfig(backend="none"))


def test_off_by_default_the_state_dict_is_as_before():
    opt = Monitored(torch.optim.SGD)(net().named_parameters(), lr=0.1, monitor=MonitorConfig(backend="none"))
    assert opt.monitor._guard is None and not opt.monitor.should_stop and not opt.monitor.step_was_skipped
    assert opt.state_dict()["monitor"] == {"step": 0}


def test_a_finite_grad_whose_norm_overflows_its_dtype_is_not_skipped():
    """fp16 grads of 30000 in every element: finite, with an fp16 norm past 65504 (inf). Not a NaN step:
    taken as the plain optimizer takes it; the step after, with an Inf in the grad, is not taken."""
    p, q = nn.Parameter(torch.ones(64, dtype=torch.float16)), nn.Parameter(torch.ones(64, dtype=torch.float16))
    opt = Monitored(torch.optim.SGD)([("w", p)], lr=1e-5, monitor=MonitorConfig(backend="none", guard="nonfinite"))
    plain = torch.optim.SGD([q], lr=1e-5)
    p.grad, q.grad = torch.full_like(p, 3e4), torch.full_like(q, 3e4)
    assert torch._foreach_norm([p.grad], 2)[0].isinf()
    opt.step()
    plain.step()
    assert not opt.monitor.step_was_skipped and torch.equal(p, q) and not torch.equal(p, torch.ones_like(p))
    p.grad[5] = math.inf
    opt.step()
    assert opt.monitor.step_was_skipped and torch.equal(p, q)


# ----- optimizers and grads off the usual path ---------------------------------------------------

class SamLike(torch.optim.Optimizer):
    """A SAM-style optimizer (not torch's own): the user's grads first, then a closure at perturbed weights."""

    def __init__(self, params, lr=0.1, rho=0.05):
        super().__init__(params, dict(lr=lr, rho=rho))

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        eps = [g["rho"] * p.grad / (p.grad.norm() + 1e-12) for g in self.param_groups for p in params]
        for p, e in zip(params, eps):
            p.add_(e)
        with torch.enable_grad():
            closure()
        for p, e in zip(params, eps):
            p.sub_(e)
            p.add_(p.grad, alpha=-self.defaults["lr"])


def test_an_optimizer_that_calls_its_closure_later_is_judged_on_the_grads_it_was_given():
    """The closure is not run early for a step that is not torch's own (it may perturb the weights
    first): the guard judges the grads given, and the run is the plain one bit for bit."""
    model, twin = net(), net()
    opt = Monitored(SamLike)(model.named_parameters(), monitor=MonitorConfig(backend="none", guard="nonfinite"))
    plain = SamLike(twin.parameters())
    for step in range(1, 6):
        for m, o in ((model, opt), (twin, plain)):
            o.zero_grad()
            loss_of(m, step).backward()
            if step == 3:
                m[0].weight.grad[0, 0] = math.nan
            if not (o is plain and step == 3):
                o.step(lambda m=m, o=o, step=step: (o.zero_grad(), loss_of(m, step).backward())[0])
        assert opt.monitor.step_was_skipped == (step == 3)
    assert_same(model, opt, twin, plain)


def test_a_restored_spike_history_with_no_grad_at_the_next_step():
    model = net()
    config = MonitorConfig(backend="none", guard="nonfinite,spikes")
    opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=1e-2, monitor=config)
    for step in range(1, 4):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
    new = Monitored(torch.optim.SGD)(net().named_parameters(), lr=1e-2, monitor=config)
    new.load_state_dict(opt.state_dict())
    new.step()  # no grads: nothing to judge
    assert not new.monitor.step_was_skipped


def test_fp16_grads_past_65504_rising_by_a_tenth_are_no_spike():
    p = nn.Parameter(torch.zeros(64, dtype=torch.float16))
    opt = Monitored(torch.optim.SGD)([("w", p)], lr=1e-9, monitor=MonitorConfig(  # lr: no change in fp16
        backend="none", guard="nonfinite,spikes", figures="norms"))
    for step in range(12):
        p.grad = torch.full_like(p, 7.5e3 * (1.1 if step == 11 else 1.0))  # a norm of 6e4, then 6.6e4
        opt.step()
        assert not opt.monitor.step_was_skipped, step


def test_the_guard_judges_by_the_names_watch_gives():
    """Bare tensors named by ``watch`` after the first step: a selection by those names is what the guard
    judges from then on."""
    model = net()
    with pytest.warns(Warning) as told:
        opt = Monitored(torch.optim.SGD)(list(model.parameters()), lr=1e-2, monitor=MonitorConfig(
            backend="none", guard="nonfinite", params="0.*"))
        opt.zero_grad()
        loss_of(model, 1).backward()
        model[0].weight.grad[0, 0] = math.nan  # not judged: no parameter is selected by its name yet
        opt.step()
    assert {"have no names", "matches none"} <= {m for w in told for m in ("have no names", "matches none")
                                                 if m in str(w.message)}
    assert not opt.monitor.step_was_skipped and model[0].weight.isnan().any()  # taken, as the plain step
    opt.monitor.watch(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss_of(model, 2).backward()
    model[0].weight.grad[0, 0] = math.nan
    opt.step()
    assert opt.monitor.step_was_skipped
    assert all(torch.allclose(p, b, rtol=0, atol=0, equal_nan=True) for p, b in zip(model.parameters(), before))


def test_step_was_skipped_tells_of_the_last_step_only():
    model = net()
    opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=1e-2,
                                     monitor=MonitorConfig(backend="none", guard="nonfinite"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    twin = net()
    plain = torch.optim.SGD(twin.parameters(), lr=1e-2)
    plain_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    seen = []
    for step in range(1, 4):
        opt.zero_grad()
        plain.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        plain_scaler.scale(loss_of(twin, step)).backward()
        if step == 1:
            model[0].weight.grad[0, 0] = math.nan  # the scaler skips it: the guard never judges it
            twin[0].weight.grad[0, 0] = math.nan
        if step == 2:
            scaler.unscale_(opt)
            model[0].weight.grad[0, 0] = math.nan  # after unscaling: the guard skips it
        scaler.step(opt)
        scaler.update()
        seen.append(opt.monitor.step_was_skipped)
        if step == 2:
            plain_scaler.unscale_(plain)  # the guard's skip: the twin leaves out its step, not the scaler's update
        else:
            plain_scaler.step(plain)
        plain_scaler.update()
    assert seen == [False, True, False]
    assert_same(model, opt, twin, plain)


def test_the_report_shows_the_guards_skips(tmp_path):
    from monitored_optim.report import load_run, summarize
    from monitored_optim.report.table import to_text

    model, opt, *_ = twin_run(torch.optim.SGD, dict(lr=1e-2), {3: math.nan, 4: math.nan}, 8, backend="jsonl",
                              logdir=str(tmp_path / "run"))
    text = to_text(summarize(load_run(tmp_path / "run")))
    assert opt.monitor.latest["guard/skipped"] == 2.0
    assert "guard/skipped 2 (2)" in text

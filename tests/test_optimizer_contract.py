"""The drop-in contract: class cache, types, arguments, hooks once, schedulers silent, closures,
gradient accumulation, the logging period and the view chosen for each step function."""

from __future__ import annotations

import inspect
import json
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import models
import truth
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.updates import CLONE, view_for
from monitored_optim.updates.adam import AdamView
from monitored_optim.updates.sgd import SgdView
from test_exactness import assert_state_dicts_equal
from thirdparty import MomentumSGD

ALL = [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
       torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.NAdam, torch.optim.RAdam,
       torch.optim.ASGD, torch.optim.SparseAdam, torch.optim.LBFGS, torch.optim.Adafactor, torch.optim.Muon]


def quiet(tmp_path, **kw):
    return MonitorConfig(backend="none", logdir=tmp_path, **kw)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_cached_subclass_of_every_builtin(cls):
    sub = Monitored(cls)
    assert sub is Monitored(cls) and Monitored(sub) is sub
    assert issubclass(sub, cls) and sub.__name__ == f"Monitored{cls.__name__}"
    assert "monitor" in inspect.signature(sub).parameters
    assert set(inspect.signature(cls).parameters) <= set(inspect.signature(sub).parameters)


@pytest.mark.parametrize("bad", [torch.optim.Adam([nn.Parameter(torch.ones(1))]), "Adam", int, None, nn.Linear])
def test_not_an_optimizer_class_is_a_type_error(bad):
    with pytest.raises(TypeError, match="expects an optimizer class, a subclass of torch.optim.Optimizer"):
        Monitored(bad)


def test_isinstance_and_refuses_what_base_refuses(tmp_path):
    p = nn.Parameter(torch.ones(3))
    with pytest.warns(UserWarning, match="parameters have no names"):
        opt = Monitored(torch.optim.AdamW)([p], lr=1e-3, monitor=quiet(tmp_path))
    assert isinstance(opt, torch.optim.AdamW)
    for kwargs, exc in [(dict(lr=-1.0), ValueError), (dict(betas=(1.5, 0.9)), ValueError), (dict(bogus=1), TypeError)]:
        with pytest.raises(exc) as plain:
            torch.optim.AdamW([p], **kwargs)
        with pytest.raises(exc) as ours:
            Monitored(torch.optim.AdamW)([p], monitor=quiet(tmp_path), **kwargs)
        assert str(plain.value).replace("AdamW.", "") in str(ours.value).replace("AdamW.", "").replace("Monitored", "")
    with pytest.raises(TypeError, match="MonitorConfig"):
        Monitored(torch.optim.AdamW)([p], monitor={"every": 2})


class Drifting(torch.optim.Adam):
    """A user subclass that overrides step(): adds a drift after the Adam step."""

    def step(self, closure=None):
        out = super().step(closure)
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    p.add_(torch.full_like(p, 1e-2).cumsum(-1))
        return out


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.LBFGS, MomentumSGD], ids=lambda c: c.__name__)
def test_overridden_methods_have_the_base_signatures(cls):
    for name in ("step", "zero_grad", "state_dict", "load_state_dict"):
        assert inspect.signature(getattr(Monitored(cls), name)) == inspect.signature(getattr(cls, name)), name


def without_monitor(sd):
    return {k: v for k, v in sd.items() if k != "monitor"}


# calls of methods whose arguments differ from torch's (MomentumSGD's), by position and by keyword
TAKEN = {
    "step positional": lambda o: o.step(None, 0.5),
    "step keywords": lambda o: o.step(scale=0.5, sign=True),
    "zero_grad keywords": lambda o: o.zero_grad(False, groups=[1]),
    "state_dict positional": lambda o: o.state_dict({"kept": 1}),
    "state_dict keywords": lambda o: o.state_dict(destination={"kept": 1}, note="n"),
    "load_state_dict positional": lambda o: o.load_state_dict(o.state_dict(note="saved"), False),
    "load_state_dict keywords": lambda o: o.load_state_dict(note="call", state=o.state_dict(), move_to_device=False),
}
REFUSED = {
    "step, an extra positional": lambda o: o.step(None, 0.5, True),
    "state_dict, an unknown keyword": lambda o: o.state_dict(keep_vars=True),
    "load_state_dict, torch's name": lambda o: o.load_state_dict(state_dict=o.state_dict()),
    "load_state_dict, none": lambda o: o.load_state_dict(),
    "load_state_dict, twice": lambda o: o.load_state_dict(o.state_dict(), state=o.state_dict()),
    "load_state_dict, an extra positional": lambda o: o.load_state_dict(o.state_dict(), False, None),
    "load_state_dict, not a dict": lambda o: o.load_state_dict([1]),
}


@pytest.mark.parametrize("call", list(TAKEN), ids=list(TAKEN))
def test_overridden_methods_take_what_the_base_takes(call, tmp_path):
    """Each call gives the monitored optimizer the plain one's result and state (a saved dict less
    its 'monitor' entry), the loaded dict's own entries and the call's arguments passed through."""
    twins = []
    for cls in (MomentumSGD, Monitored(MomentumSGD)):
        problem = models.mlp()
        opt = cls(problem.groups, lr=0.1, count=int, **({} if cls is MomentumSGD else {"monitor": quiet(tmp_path)}))
        for i in range(2):
            opt.zero_grad()
            problem.loss(i).backward()
            opt.step()
            out = TAKEN[call](opt)
        twins.append((problem, opt, out))
    (plain_problem, plain, plain_out), (problem, opt, out) = twins
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(problem.named, plain_problem.named))
    assert all((a.grad is None) == (b.grad is None) for (_, a), (_, b) in zip(problem.named, plain_problem.named))
    assert_state_dicts_equal(opt.state_dict(), plain.state_dict())
    assert getattr(opt, "loaded_with", None) == getattr(plain, "loaded_with", None)
    if isinstance(plain_out, dict):
        assert without_monitor(out).keys() == plain_out.keys() and out["kept"] == 1
        assert_state_dicts_equal(out, plain_out)
    assert opt.monitor.step == plain.param_groups[0]["step"]  # a loaded dict's own count


class Forwarding(MomentumSGD):
    """A subclass whose load_state_dict forwards ``*args, **kwargs`` (as a decorating wrapper does)."""

    def load_state_dict(self, *args, **kwargs):
        super().load_state_dict(*args, **kwargs)


def test_a_state_dict_given_through_star_args_gives_its_count(tmp_path):
    problem = models.mlp()
    opt = Monitored(Forwarding)(problem.groups, lr=0.1, monitor=quiet(tmp_path))
    for i in range(2):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()
    fresh = Monitored(Forwarding)(problem.groups, lr=0.1, monitor=quiet(tmp_path))
    fresh.load_state_dict(opt.state_dict(), move_to_device=False)
    assert fresh.monitor.step == 2 and fresh.loaded_with == (None, False, None)
    assert_state_dicts_equal(fresh.state_dict(), opt.state_dict())


@pytest.mark.parametrize("call", list(REFUSED), ids=list(REFUSED))
def test_overridden_methods_refuse_what_the_base_refuses(call, tmp_path):
    problem = models.mlp()
    plain = MomentumSGD(problem.groups, lr=0.1)
    opt = Monitored(MomentumSGD)(problem.groups, lr=0.1, monitor=quiet(tmp_path))
    with pytest.raises(Exception) as refused:
        REFUSED[call](plain)
    with pytest.raises(type(refused.value)) as ours:
        REFUSED[call](opt)
    assert str(ours.value) == str(refused.value)


def test_views_are_chosen_by_step_function():
    class RenamedAdam(torch.optim.Adam):
        pass

    assert isinstance(view_for(torch.optim.Adam), AdamView)
    assert isinstance(view_for(torch.optim.AdamW), AdamView)
    assert isinstance(view_for(RenamedAdam), AdamView)
    assert isinstance(view_for(torch.optim.SGD), SgdView)
    assert view_for(Drifting) is CLONE
    assert view_for(torch.optim.LBFGS) is CLONE


def test_drifting_subclass_gets_true_figures(tmp_path):
    problem = models.mlp(two_groups=False)
    opt = Monitored(Drifting)(problem.named, lr=1e-3, monitor=quiet(tmp_path))
    problem.loss(0).backward()
    before = problem.model["fc1"].weight.detach().clone()
    opt.step()
    u = (problem.model["fc1"].weight.detach() - before).double()
    assert opt.monitor.latest["update_norm/fc1.weight"] == pytest.approx(u.norm().item(), rel=1e-6)


@pytest.mark.parametrize("plain_first", [False, True])
def test_hooks_fire_once_per_step(plain_first, tmp_path):
    p = nn.Parameter(torch.ones(4))
    if plain_first:  # torch then wraps Adam.step itself; calling it via super() would fire hooks twice
        torch.optim.Adam([nn.Parameter(torch.ones(1))])
    calls = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append("gpre")),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append("gpost"))]
    try:
        with pytest.warns(UserWarning, match="parameters have no names"):
            opt = Monitored(torch.optim.Adam)([p], lr=0.1, monitor=quiet(tmp_path))
        opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
        opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
        for _ in range(2):
            p.grad = torch.ones(4)
            opt.step()
    finally:
        for h in handles:
            h.remove()
    assert calls == ["gpre", "pre", "post", "gpost"] * 2
    assert opt.monitor.step == 2


SCHEDULERS = [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
]


@pytest.mark.parametrize("make", SCHEDULERS, ids=["StepLR", "OneCycleLR", "LambdaLR", "CosineAnnealingLR"])
def test_schedulers_work_silently_and_lr_is_the_one_used(make, tmp_path):
    problem = models.mlp(two_groups=False)
    opt = Monitored(torch.optim.SGD)(problem.named, lr=0.1, momentum=0.9, monitor=quiet(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the model's unused layer
        warnings.filterwarnings("ignore", "monitored_optim. parameter 'unused", RuntimeWarning)
        sched = make(opt)
        for i in range(6):
            opt.zero_grad()
            problem.loss(i).backward()
            used = opt.param_groups[0]["lr"]
            opt.step()
            assert opt.monitor.latest["lr/group0"] == pytest.approx(used, rel=1e-15)
            sched.step()


def test_closure_returns_loss_and_grad_is_the_closures(tmp_path):
    problem = models.mlp(two_groups=False)
    opt = Monitored(torch.optim.SGD)(problem.named, lr=0.1, monitor=quiet(tmp_path))
    loss_seen = []

    def closure():
        opt.zero_grad()
        loss = problem.loss(0)
        loss.backward()
        loss_seen.append(loss)
        return loss

    out = opt.step(closure=closure)
    assert out is loss_seen[0]
    assert opt.monitor.latest["grad_norm/fc1.weight"] > 0
    assert "grad_norm/unused.weight" not in opt.monitor.latest


def test_gradient_accumulation_counts_optimizer_steps_only(tmp_path):
    problem = models.mlp(two_groups=False)
    opt = Monitored(torch.optim.AdamW)(problem.named, lr=1e-3, monitor=MonitorConfig(
        backend="jsonl", logdir=tmp_path, every=2))
    for _ in range(6):
        for micro in range(4):
            (problem.loss(micro) / 4).backward()
        opt.step()
        opt.zero_grad()
    opt.monitor.close()
    assert opt.monitor.step == 6
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4, 6]


@pytest.mark.parametrize("every", [1, 3, 5])
def test_every_logs_multiples_only(every, tmp_path):
    problem = models.mlp(two_groups=False)
    opt = Monitored(torch.optim.SGD)(problem.named, lr=0.1, monitor=MonitorConfig(
        backend="jsonl", logdir=tmp_path, every=every))
    latest_steps = []
    for i in range(10):
        opt.zero_grad()
        problem.loss(i).backward()
        before = dict(opt.monitor.latest)
        opt.step()
        if opt.monitor.latest is not before and opt.monitor.latest != before:
            latest_steps.append(opt.monitor.step)
    opt.monitor.close()
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [s for s in range(1, 11) if s % every == 0] == latest_steps


def test_unnamed_parameters_get_stable_names_and_one_warning(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="named_parameters") as record:
        opt = Monitored(torch.optim.Adam)([{"params": [model[0].weight, model[0].bias]},
                                           {"params": list(model[1].parameters()), "lr": 1e-2}],
                                          monitor=quiet(tmp_path))
        for _ in range(3):
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
    assert sum("named_parameters" in str(w.message) for w in record) == 1
    assert {k.split("/")[1] for k in opt.monitor.latest if k.startswith("param_norm/")} == {
        "param0", "param1", "param2", "param3"}
    assert {"lr/group0", "lr/group1"} <= set(opt.monitor.latest)


def test_named_groups_label_learning_rates(tmp_path):
    model = nn.Linear(3, 2)
    opt = Monitored(torch.optim.SGD)([{"params": [("w", model.weight)], "name": "decay", "lr": 0.1},
                                      {"params": [("b", model.bias)], "name": "no_decay", "lr": 0.2}],
                                     monitor=quiet(tmp_path))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert opt.monitor.latest["lr/decay"] == 0.1 and opt.monitor.latest["lr/no_decay"] == 0.2


def test_deepcopy_and_pickle_keep_config_and_step(tmp_path):
    import copy

    problem = models.mlp(two_groups=False)
    opt = Monitored(torch.optim.Adam)(problem.named, lr=1e-3, monitor=quiet(tmp_path, every=2))
    problem.loss(0).backward()
    opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert type(clone) is type(opt)
        assert clone.monitor.step == 1 and clone.monitor.settings.every == 2


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.LBFGS, torch.optim.SGD])
def test_generated_class_pickles_by_reference(cls):
    assert pickle.loads(pickle.dumps(Monitored(cls))) is Monitored(cls)


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.Adam, {"lr": 1e-2}), (torch.optim.SGD, {"lr": 0.1})],
                         ids=["adam", "sgd"])
@pytest.mark.parametrize("before", ["none", "stale"])
def test_a_closure_gives_the_grads_of_a_parameter_cut_into_parts(cls, kwargs, before, tmp_path):
    """A 300 x 300 matrix (cut into parts by the eager capture) whose grad before ``step(closure)`` is
    None (``zero_grad(set_to_none=True)``) or a stale constant: its grad figures are those of the
    grad the closure made (each part's grad was cut before the closure ran)."""
    gen = torch.Generator().manual_seed(0)
    named = [("big", nn.Parameter(torch.randn(300, 300, generator=gen))),
             ("small", nn.Parameter(torch.randn(10, generator=gen)))]
    opt = Monitored(cls)(named, **kwargs, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in named}
    for _, p in named:
        p.grad = None if before == "none" else torch.full_like(p, 5.0)

    def closure():
        for n, p in named:
            p.grad = grads[n].clone()
        return torch.tensor(0.0)

    snapshot, _ = truth.snapshot(named)
    opt.step(closure)
    truth.assert_figures_match(opt.monitor.latest, truth.figures(named, snapshot, grads))


def test_a_monitored_optimizer_is_freed_without_the_garbage_collector(tmp_path):
    """No reference cycle runs through the monitor: dropping the optimizer frees it (and closes its
    files) at once, as a plain optimizer is freed, not at some later collection."""
    import gc
    import weakref

    net = torch.nn.Linear(3, 2)
    was_on = gc.isenabled()
    gc.disable()
    try:
        opt = Monitored(torch.optim.AdamW)(net.named_parameters(), lr=0.1, monitor=MonitorConfig(
            backend="jsonl", logdir=tmp_path, every=1))
        net(torch.ones(1, 3)).sum().backward()
        opt.step()
        monitor = weakref.ref(opt.monitor)
        del opt
        assert monitor() is None
    finally:
        if was_on:
            gc.enable()

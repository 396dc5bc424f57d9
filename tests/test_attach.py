"""``attach()``: an optimizer that already exists, monitored in place. Its figures against the clone
truth, its trajectory bit for bit the never-attached optimizer's, what wrapped or hooked its step
before (an LR scheduler, hooks, accelerate's wrapper) still run once per step, and the step axis
continues where the optimizer was."""

from __future__ import annotations

import copy
import functools
import io
import pickle
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from monitored_optim import Monitored, MonitorConfig, attach, monitor_of
from truth import assert_figures_match, figures, snapshot


class Steps(torch.optim.SGD):
    """A user subclass that overrides ``step`` (the clone route)."""

    def step(self, closure=None):
        return super().step(closure)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam_forloop": (torch.optim.Adam, {"lr": 1e-2, "foreach": False}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "warmup_lr": (torch.optim.AdamW, {"lr": 1e-7}),
    "user_subclass": (Steps, {"lr": 1e-2, "momentum": 0.9}),
}


def model(dtype=torch.float32) -> torch.nn.Module:
    """A linear layer, a LayerNorm at 1.0 with its bias at 0, and a head."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).to(dtype)


def loss(m: torch.nn.Module, i: int) -> torch.Tensor:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(i)).to(next(m.parameters()).dtype)
    return m(x).float().square().mean()


def run(cls, kwargs, steps: int, attach_at: int | None, truths: list | None = None, dtype=torch.float32):
    """Train ``steps`` steps with an LR scheduler and step hooks built first; attach at step
    ``attach_at`` (None: never). Returns the model, the optimizer and the hooks' calls."""
    m = model(dtype)
    opt = cls(m.parameters(), **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    calls = {"pre": 0, "post": 0, "global": 0}
    opt.register_step_pre_hook(lambda *_: calls.__setitem__("pre", calls["pre"] + 1))
    opt.register_step_post_hook(lambda *_: calls.__setitem__("post", calls["post"] + 1))
    handle = register_optimizer_step_post_hook(
        lambda o, *_: calls.__setitem__("global", calls["global"] + (o is opt)))
    try:
        for i in range(steps):
            if i == attach_at:
                assert attach(opt, MonitorConfig(backend="none", every=1, model=m)) is opt
            opt.zero_grad()
            loss(m, i).backward()
            if truths is not None and attach_at is not None and i >= attach_at:
                named = list(m.named_parameters())
                before, grads = snapshot(named)
                opt.step()
                truths.append((figures(named, before, grads), dict(opt.monitor.latest), opt.monitor.step))
            else:
                opt.step()
            scheduler.step()
    finally:
        handle.remove()
    return m, opt, calls


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_attached_after_steps_is_exact_and_changes_nothing(name):
    cls, kwargs = OPTIMIZERS[name]
    plain_model, plain, plain_calls = run(cls, kwargs, 9, None)
    truths: list = []
    counted = "momentum" not in kwargs  # SGD keeps no step count
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m, opt, calls = run(cls, kwargs, 9, 4, truths)
    # no scheduler warning that step() was overridden; the one notice where the optimizer keeps no count,
    # and where lr 1e-7 moves no element of the LayerNorm at 1.0
    expected = ([] if counted else [f"the {cls.__name__} attached has taken steps but keeps no step count"]) + (
        ["parameter '1.weight' has a gradient but has not changed"] if kwargs["lr"] < 1e-6 else [])
    assert len(seen) == len(expected) and all(want in str(w.message) for w, want in zip(seen, expected))
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), m.parameters()))
    assert all(torch.equal(a, b) for s, t in zip(plain.state.values(), opt.state.values()) for a, b in
               zip(s.values(), t.values()) if isinstance(a, torch.Tensor))
    assert calls == plain_calls  # every hook as often as before (once per step, twice under super().step)
    assert calls["pre"] == calls["post"] == calls["global"] == 9 * (1 + (cls is Steps))
    assert isinstance(opt, cls) and type(opt) is Monitored(cls)
    # the axis continues at the steps taken
    assert [step for *_, step in truths] == ([5, 6, 7, 8, 9] if counted else [1, 2, 3, 4, 5])
    for expected, logged, _ in truths:
        assert_figures_match(without_lost(logged), expected)


@pytest.mark.parametrize("how", ["attach", "load_state_dict"])
def test_an_optimizer_whose_state_keeps_a_count_of_0_is_no_alarm(how):
    """Adagrad builds its state, with ``step`` 0, before any step: attached, or given a state dict of
    such an optimizer, it keeps a count (0), so the axis starts at step 1 without a word."""
    model = torch.nn.Linear(4, 2)
    fresh = torch.optim.Adagrad(model.parameters(), lr=0.1)
    assert fresh.state and all(float(s["step"]) == 0 for s in fresh.state.values())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if how == "attach":
            opt = attach(fresh, MonitorConfig(backend="none", model=model))
        else:
            opt = Monitored(torch.optim.Adagrad)(model.named_parameters(), lr=0.1,
                                                 monitor=MonitorConfig(backend="none"))
            opt.load_state_dict(fresh.state_dict())
    assert [str(w.message) for w in seen] == [] and opt.monitor.step == 0


def without_lost(logged: dict[str, float]) -> dict[str, float]:
    """The figures less ``update_lost/*`` (the elements a step lost to rounding: not in the truth)."""
    return {k: v for k, v in logged.items() if not k.startswith("update_lost/")}


def test_bf16_parameters_attached():
    truths: list = []
    run(torch.optim.AdamW, {"lr": 2e-2}, 5, 2, truths, dtype=torch.bfloat16)
    for expected, logged, _ in truths:
        assert_figures_match(without_lost(logged), expected, norm_rtol=1e-3)
        assert 0 <= logged["update_lost/1.weight"] <= 1


def test_attaching_twice_is_one_monitor_and_the_state_round_trips(tmp_path):
    m, opt, _ = run(torch.optim.AdamW, {"lr": 1e-2}, 4, 1)
    monitor = opt.monitor
    assert attach(opt) is opt and opt.monitor is monitor and opt.monitor.step == 4
    for restored in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        assert type(restored) is Monitored(torch.optim.AdamW) and restored.monitor.step == 4
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).monitor.step == 4
    plain = torch.optim.AdamW(m.parameters(), lr=1e-2)
    plain.load_state_dict(opt.state_dict())
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(plain.state.values(), opt.state.values()))


def test_the_optimizer_inside_accelerates_wrapper_is_monitored():
    accelerate = pytest.importorskip("accelerate")
    m = model()
    accelerator = accelerate.Accelerator(cpu=True)
    m, wrapped = accelerator.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-2))
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(wrapped.optimizer, step_size=2))
    assert attach(wrapped, MonitorConfig(backend="none", every=1, model=m)) is wrapped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            named = list(m.named_parameters())
            wrapped.zero_grad()
            accelerator.backward(loss(m, i))
            before, grads = snapshot(named)
            wrapped.step()
            scheduler.step()
            assert_figures_match(monitor_of(wrapped).latest, figures(named, before, grads))
    assert wrapped.optimizer.monitor.step == 3


def test_monitored_partial_is_the_partial_of_the_monitored_class():
    bound = Monitored(functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.05))
    assert isinstance(bound, functools.partial) and bound.func is Monitored(torch.optim.AdamW)
    opt = bound(model().named_parameters(), monitor=MonitorConfig(backend="none"))
    assert opt.defaults["weight_decay"] == 0.05 and opt.defaults["lr"] == 1e-3


def test_bad_input_fails_before_the_optimizer_changes():
    with pytest.raises(TypeError, match="attach"):
        attach(object())
    opt = torch.optim.SGD(model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="every"):
        attach(opt, MonitorConfig(every=0))
    assert type(opt) is torch.optim.SGD


def test_monitor_of_finds_the_monitor_through_the_wrappers():
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="AdamW in AdamW is not monitored"):
        monitor_of(opt)
    with pytest.raises(TypeError, match="attach"):
        monitor_of(m)
    attach(opt, MonitorConfig(backend="none", model=m))
    assert monitor_of(opt) is opt.monitor


def test_a_wrapper_attach_cannot_follow_and_a_second_config_are_told():
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt.step = functools.partial(lambda step, *a, **k: step(*a, **k), opt.step)  # holds the bound method
    with pytest.warns(RuntimeWarning, match="wrapped before attach\\(\\) in a way it cannot follow"):
        attach(opt, MonitorConfig(backend="none", model=m))
    with pytest.warns(RuntimeWarning, match="already monitored, with MonitorConfig"):
        attach(opt, MonitorConfig(backend="none", every=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attach(opt)  # no configuration given: nothing to tell
        built = Monitored(torch.optim.SGD)(m.named_parameters(), lr=0.1, monitor=MonitorConfig(backend="none"))
        attach(built, MonitorConfig(backend="none"))  # the same configuration

"""Sharing a training stack: the x axis (counted as updates or as step() calls, settable, warned when
it goes back), names for groups of bare tensors, and the warnings that name a parameter."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import models
from monitored_optim import Monitored, MonitorConfig
from test_health import amp_loop


def read_jsonl(logdir):
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_count_calls_lines_up_with_the_trainers_global_step(fused, tmp_path):
    """count="calls": an AMP-skipped step() call counts, as HF's and Lightning's global step do; it is
    still not logged as an update. The trajectory is the plain optimizer's."""
    kwargs = dict(lr=1e-2, fused=fused)
    plain_problem, _, _ = amp_loop(torch.optim.AdamW, kwargs, None, inject_at=2)
    problem, opt, _ = amp_loop(Monitored(torch.optim.AdamW), kwargs,
                               MonitorConfig(backend="jsonl", logdir=tmp_path, count="calls"), inject_at=2)
    opt.monitor.close()
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(problem.named, plain_problem.named))
    assert opt.monitor.step == 6 and opt.monitor.health.skipped_steps == 1
    assert [row["step"] for row in read_jsonl(tmp_path)] == [1, 2, 4, 5, 6]


def train(opt, problem, steps):
    for i in range(steps):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()


def test_a_plain_checkpoint_without_steps_warns_and_the_step_can_be_set(tmp_path):
    problem = models.mlp()
    plain = torch.optim.SGD(problem.groups, lr=0.1, momentum=0.9)
    train(plain, problem, 3)
    opt = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, momentum=0.9,
                                     monitor=MonitorConfig(backend="jsonl", logdir=tmp_path))
    with pytest.warns(RuntimeWarning, match="has optimizer state but no step count.*set opt.monitor.step"):
        opt.load_state_dict(plain.state_dict())
    opt.monitor.step = 3
    train(opt, problem, 2)
    opt.monitor.close()
    assert [row["step"] for row in read_jsonl(tmp_path)] == [4, 5]
    with pytest.raises(ValueError, match="expected an integer >= 0"):
        opt.monitor.step = "3"


def test_an_axis_that_goes_back_is_warned_once(tmp_path):
    problem = models.mlp()
    opt = Monitored(torch.optim.Adam)(problem.groups, lr=1e-2, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    train(opt, problem, 4)
    early = torch.optim.Adam(problem.groups, lr=1e-2)
    train(early, problem, 1)
    with pytest.warns(RuntimeWarning, match="moves back from 4 to 1, below step 4 that it already logged"):
        opt.load_state_dict(early.state_dict())  # a plain state dict from step 1, mid-run
    assert opt.monitor.step == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.monitor.step = 0  # told once


def test_a_rollback_to_a_checkpoint_of_the_monitored_class_is_no_alarm(tmp_path):
    """Saved at step 5, trained to 10, the step-5 state dict loaded (it carries the count): the rollback
    is deliberate and the count right, so no warning, and the next logged step is 6. Setting the
    step by hand below a logged step still warns, with its advice."""
    problem = models.mlp()
    opt = Monitored(torch.optim.Adam)(problem.groups, lr=1e-2, monitor=MonitorConfig(backend="jsonl", logdir=tmp_path))
    train(opt, problem, 5)
    saved = opt.state_dict()
    assert saved["monitor"] == {"step": 5}
    train(opt, problem, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(saved)
        assert opt.monitor.step == 5
        train(opt, problem, 2)
    opt.monitor.close()
    assert [row["step"] for row in read_jsonl(tmp_path)] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 6, 7]
    with pytest.warns(RuntimeWarning, match="moves back from 7 to 3, below step 7 that it already logged.*"
                                            "set opt.monitor.step to the step your checkpoint was saved at"):
        opt.monitor.step = 3


@pytest.mark.parametrize("how", ["config", "watch"])
def test_groups_of_bare_tensors_are_named_from_the_model(how, tmp_path):
    """nanoGPT's configure_optimizers and HF's optimizer_cls_and_kwargs give groups of bare tensors;
    with the model at hand the figures carry its names (a tied weight under its first name)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"wte": torch.nn.Embedding(10, 4), "ln": torch.nn.LayerNorm(4),
                                 "head": torch.nn.Linear(4, 10, bias=False)})
    model["head"].weight = model["wte"].weight  # tied
    params = [p for p in model.parameters()]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    config = MonitorConfig(backend="none", logdir=tmp_path, model=model if how == "config" else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = Monitored(torch.optim.AdamW)(groups, lr=1e-2, monitor=config)
        if how == "watch":
            opt.monitor.watch(model)
    unnamed = [w for w in caught if "have no names" in str(w.message)]
    assert len(unnamed) == (1 if how == "watch" else 0)  # watch() comes after construction's warning
    x = torch.randint(0, 10, (8,))
    opt.zero_grad()
    model["head"](model["ln"](model["wte"](x))).logsumexp(-1).mean().backward()
    opt.step()
    names = {tag.split("/", 1)[1] for tag in opt.monitor.latest if tag.startswith("update_norm/")}
    assert names == {"wte.weight", "ln.weight", "ln.bias"}


def test_a_parameter_without_grad_is_warned_by_name_after_three_logging_steps(tmp_path):
    problem = models.mlp()
    opt = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(opt, problem, 2)
        assert not [w for w in caught if "no gradient" in str(w.message)]
        train(opt, problem, 3)
    told = [str(w.message) for w in caught if "has had no gradient for 3" in str(w.message)]
    assert len(told) == 1 and "parameter 'unused.weight' has had" in told[0]  # one warning names both
    assert "(the same for 1 more parameter: 'unused.bias')" in told[0]



@pytest.mark.parametrize("compile", [False, True], ids=["eager", "fused"])
def test_a_parameter_frozen_on_purpose_is_counted_but_not_warned_about(compile, tmp_path):
    """A parameter set to ``requires_grad=False`` after the optimizer took it (a frozen layer left in
    the optimizer, as fine-tuning code often does) has no grad by design: ``health/no_grad`` counts it,
    and only the unused layer, which has no grad by mistake, is warned about."""
    problem = models.mlp()
    problem.model["fc1"].weight.requires_grad_(False)
    opt = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, monitor=MonitorConfig(
        backend="none", logdir=tmp_path, compile=compile))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(opt, problem, 5)
    told = [str(w.message) for w in caught if "no gradient" in str(w.message)]
    assert len(told) == 1 and "parameter 'unused.weight' has had" in told[0], told
    assert "fc1.weight" not in told[0] and "(the same for 1 more parameter: 'unused.bias')" in told[0]
    assert opt.monitor.latest["health/no_grad"] == 3  # fc1.weight, unused.weight, unused.bias


def test_a_parameter_frozen_on_purpose_with_a_stale_zero_grad_is_not_warned_about_as_unchanged(tmp_path):
    """Frozen after two steps under ``zero_grad(set_to_none=False)``: its grad stays a tensor of zeros
    and plain SGD leaves it where it is, by design. ``health/unchanged`` counts it, no warning names
    it; a layer the step leaves alone by mistake (lr 0) still gets the warning."""
    problem = models.mlp()
    groups = problem.groups
    groups[1]["lr"] = 0.0  # fc2.* get grads but never move: by mistake
    opt = Monitored(torch.optim.SGD)(groups, lr=0.1, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            if i == 2:
                problem.model["fc1"].weight.requires_grad_(False)
            opt.zero_grad(set_to_none=False)
            problem.loss(i).backward()
            opt.step()
    told = [str(w.message) for w in caught if "has not changed" in str(w.message)]
    assert len(told) == 1 and "parameter 'fc2.weight' has" in told[0] and "fc1.weight" not in told[0], told
    assert opt.monitor.latest["health/unchanged"] == 3  # fc1.weight (frozen), fc2.weight, fc2.bias

def test_shared_logdir_is_warned_only_while_both_monitors_are_open(tmp_path):
    config = MonitorConfig(backend="jsonl", logdir=tmp_path)
    problem = models.mlp()
    first = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, monitor=config)
    train(first, problem, 2)
    with pytest.warns(UserWarning, match="two monitored optimizers log the same tags"):
        second = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, monitor=config)
    second.monitor.close()
    first.monitor.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, monitor=config)  # after close: a resume
    resumed.load_state_dict(first.state_dict())
    train(resumed, problem, 1)
    resumed.monitor.close()
    assert [row["step"] for row in read_jsonl(tmp_path)] == [1, 2, 3]

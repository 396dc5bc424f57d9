"""Checkpoints and failures: pickling, torch.save in a fresh process, state_dict interchange with the
plain class, several optimizers in one logdir, failing backends, and runs that die."""

from __future__ import annotations

import copy
import inspect
import json
import pickle
import warnings
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import models
from monitored_optim import Monitored, MonitorConfig
from test_backends import read_jsonl, read_tensorboard
from thirdparty import MomentumSGD, SignSGD

TESTS = Path(__file__).resolve().parent


def steps(problem, opt, start, count):
    for i in range(start, start + count):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, SignSGD], ids=["AdamW", "third-party"])
def test_class_pickles_by_reference(cls):
    assert pickle.loads(pickle.dumps(Monitored(cls))) is Monitored(cls)


@pytest.mark.parametrize("roundtrip", ["pickle", "deepcopy", "torch.save"])
def test_instance_roundtrip_keeps_config_state_and_step(roundtrip, tmp_path):
    problem = models.mlp()
    opt = Monitored(torch.optim.Adam)(problem.groups, lr=1e-2, monitor=MonitorConfig(
        backend="jsonl", logdir=tmp_path, every=2))
    steps(problem, opt, 0, 3)
    with pytest.warns(UserWarning, match="two monitored optimizers log the same tags"):  # the copy and the original
        if roundtrip == "pickle":
            other = pickle.loads(pickle.dumps(opt))
        elif roundtrip == "deepcopy":
            other = copy.deepcopy(opt)
        else:
            torch.save(opt, tmp_path / "opt.pt")
            other = torch.load(tmp_path / "opt.pt", weights_only=False)
    assert type(other) is type(opt) and other.monitor.step == 3 and other.monitor.settings.every == 2
    from test_exactness import assert_state_dicts_equal
    assert_state_dicts_equal(opt.state_dict(), other.state_dict())


@pytest.mark.parametrize("roundtrip", ["pickle", "deepcopy"])
def test_names_from_a_watched_model_survive_a_roundtrip(roundtrip, tmp_path):
    """Groups of bare tensors named by ``MonitorConfig(model=model)``: the model is not saved with the
    optimizer, its names are, so the copy logs the same tags and warns of no unnamed parameters."""
    problem = models.mlp()
    opt = Monitored(torch.optim.Adam)([p for _, p in problem.model.named_parameters()], lr=1e-2, monitor=MonitorConfig(
        backend="jsonl", logdir=tmp_path, model=problem.model))
    steps(problem, opt, 0, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = pickle.loads(pickle.dumps(opt)) if roundtrip == "pickle" else copy.deepcopy(opt)
    assert not [w for w in caught if "have no names" in str(w.message)]
    for group in other.param_groups:  # the copy's own tensors
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    other.step()
    assert {t for t in other.monitor.latest if t.startswith("update_norm/")} == \
        {t for t in opt.monitor.latest if t.startswith("update_norm/")}


def test_torch_save_then_load_and_continue_in_a_fresh_process(tmp_path):
    problem = models.mlp()
    config = MonitorConfig(backend="jsonl", logdir=tmp_path / "run")
    opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=config)
    steps(problem, opt, 0, 3)
    opt.monitor.close()
    torch.save({"model": problem.model.state_dict(), "opt": opt}, tmp_path / "ckpt.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(TESTS)!r})
        import models
        ckpt = torch.load({str(tmp_path / "ckpt.pt")!r}, weights_only=False)
        opt = ckpt["opt"]
        print(type(opt).__name__, opt.monitor.step)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["MonitoredAdamW", "3"]


def test_state_dict_interchange_with_plain_class_is_bitwise_and_continues_steps(tmp_path):
    from test_exactness import assert_state_dicts_equal

    cfg = MonitorConfig(backend="jsonl", logdir=tmp_path)
    reference = models.mlp()
    ref_opt = torch.optim.AdamW(reference.groups, lr=1e-2)
    steps(reference, ref_opt, 0, 6)

    # monitored for 3 steps -> plain for 3 steps
    a = models.mlp()
    mon = Monitored(torch.optim.AdamW)(a.groups, lr=1e-2, monitor=cfg)
    steps(a, mon, 0, 3)
    mon.monitor.close()  # done with it, as after saving a checkpoint: the resumed one below shares its logdir
    plain = torch.optim.AdamW([{"params": g["params"]} for g in mon.param_groups], lr=1e-2)
    plain.load_state_dict(mon.state_dict())
    steps(a, plain, 3, 3)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named, reference.named))
    assert_state_dicts_equal(plain.state_dict(), ref_opt.state_dict())

    # plain for 3 steps -> monitored (resumed) for 3 steps, logging steps 4..6 after 1..3
    b = models.mlp()
    plain_b = torch.optim.AdamW(b.groups, lr=1e-2)
    steps(b, plain_b, 0, 3)
    resumed = Monitored(torch.optim.AdamW)(b.groups, lr=1e-2, monitor=cfg)
    resumed.load_state_dict(plain_b.state_dict())
    assert resumed.monitor.step == 3
    steps(b, resumed, 3, 3)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(b.named, reference.named))
    mon.monitor.close()
    resumed.monitor.close()
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]


def test_monitored_state_dict_resumes_its_step_count(tmp_path):
    problem = models.mlp()
    opt = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, monitor=MonitorConfig(backend="none"))
    steps(problem, opt, 0, 4)
    sd = opt.state_dict()
    assert sd["monitor"] == {"step": 4}
    fresh = Monitored(torch.optim.SGD)(models.mlp().groups, lr=0.1, monitor=MonitorConfig(backend="none"))
    fresh.load_state_dict(sd)
    assert fresh.monitor.step == 4


def lookahead(cls, params, **monitor):
    """pytorch-optimizer's Lookahead around AdamW, as its users build it: the wrapped optimizer is an
    instance, and ``Monitored(Lookahead)`` monitors the wrapper's steps (the slow-weight pulls included)."""
    from pytorch_optimizer import Lookahead

    return Monitored(Lookahead)(torch.optim.AdamW(params, lr=1e-2), k=2, **monitor) if cls == "monitored" else \
        Lookahead(torch.optim.AdamW(params, lr=1e-2), k=2)


def schedule_free(cls, params, **monitor):
    """schedulefree's AdamWScheduleFree, in train mode as its step requires; it counts steps in group["k"]."""
    from schedulefree import AdamWScheduleFree

    opt = (Monitored(AdamWScheduleFree) if cls == "monitored" else AdamWScheduleFree)(params, lr=1e-2, **monitor)
    opt.train()
    return opt


def momentum_sgd(count):
    def make(cls, params, **monitor):
        return (Monitored(MomentumSGD) if cls == "monitored" else MomentumSGD)(params, lr=0.1, count=count, **monitor)
    return make


# optimizers whose plain state dict holds a step count elsewhere than in state[p]["step"]
KEPT_COUNTS = {"group step int": momentum_sgd(int), "group step float": momentum_sgd(float),
               "group step tensor": momentum_sgd(torch.tensor), "schedulefree k": schedule_free,
               "Lookahead's wrapped AdamW": lookahead}


def resume_plain_checkpoint(make, logdir):
    """Three plain steps, the plain state dict loaded into a monitored optimizer on the same model,
    one monitored step: the steps it logged, and whether the model matches four plain steps'."""
    reference, problem = models.mlp(), models.mlp()
    steps(reference, make("plain", reference.groups), 0, 4)
    plain = make("plain", problem.groups)
    steps(problem, plain, 0, 3)
    opt = make("monitored", problem.groups, monitor=MonitorConfig(backend="jsonl", logdir=logdir))
    opt.load_state_dict(plain.state_dict())
    steps(problem, opt, 3, 1)
    opt.monitor.close()
    return list(read_jsonl(logdir)), all(torch.equal(a, b) for (_, a), (_, b) in zip(problem.named, reference.named))


@pytest.mark.parametrize("case", list(KEPT_COUNTS), ids=list(KEPT_COUNTS))
def test_a_plain_checkpoint_continues_the_axis_from_the_count_its_optimizer_keeps(case, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logged, same = resume_plain_checkpoint(KEPT_COUNTS[case], tmp_path)
    assert logged == [4] and same


def test_a_plain_checkpoint_without_a_count_still_warns(tmp_path):
    with pytest.warns(RuntimeWarning, match="has optimizer state but no step count"):
        logged, same = resume_plain_checkpoint(momentum_sgd(None), tmp_path)
    assert logged == [1] and same


def test_pytorch_optimizers_lookahead_round_trips_by_its_own_argument_name(tmp_path):
    """Monitored(Lookahead): its state_dict loads back by Lookahead's own name for the state dict,
    ``state``; the count continues and the trajectory is the plain Lookahead's, bit for bit."""
    from pytorch_optimizer import Lookahead

    assert inspect.signature(Monitored(Lookahead).load_state_dict) == inspect.signature(Lookahead.load_state_dict)
    reference, problem = models.mlp(), models.mlp()
    ref = lookahead("plain", reference.groups)
    steps(reference, ref, 0, 6)
    opt = lookahead("monitored", problem.groups, monitor=MonitorConfig(backend="jsonl", logdir=tmp_path))
    steps(problem, opt, 0, 3)
    saved = opt.state_dict()
    opt.monitor.close()
    assert saved["monitor"] == {"step": 3}
    resumed = lookahead("monitored", problem.groups, monitor=MonitorConfig(backend="jsonl", logdir=tmp_path))
    resumed.load_state_dict(state=saved)
    steps(problem, resumed, 3, 3)
    resumed.monitor.close()
    assert list(read_jsonl(tmp_path)) == [1, 2, 3, 4, 5, 6]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(problem.named, reference.named))
    from test_exactness import assert_state_dicts_equal
    assert_state_dicts_equal(resumed.state_dict()["base_optimizer"], ref.state_dict()["base_optimizer"])
    plain = lookahead("plain", problem.groups)
    plain.load_state_dict(state=resumed.state_dict())  # and into the plain class, which ignores 'monitor'


def test_two_optimizers_share_a_logdir_with_prefixes(tmp_path):
    gen, disc = models.mlp(), models.mlp()
    opt_g = Monitored(torch.optim.Adam)(gen.groups, lr=1e-3, monitor=MonitorConfig(
        backend="jsonl,tensorboard", logdir=tmp_path, prefix="gen"))
    opt_d = Monitored(torch.optim.SGD)(disc.groups, lr=1e-2, monitor=MonitorConfig(
        backend="jsonl,tensorboard", logdir=tmp_path, prefix="disc"))
    latest = {}
    for i in range(3):
        for problem, opt in ((gen, opt_g), (disc, opt_d)):
            steps(problem, opt, i, 1)
            latest.setdefault(i + 1, {}).update(opt.monitor.latest)
    opt_g.monitor.close()
    opt_d.monitor.close()
    assert all(tag.startswith(("gen/", "disc/")) for tag in latest[3])
    assert "gen/update_to_data/fc1.weight" in latest[3] and "disc/lr/group0" in latest[3]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    merged = {}
    for line in lines:
        merged.setdefault(line.pop("step"), {}).update(line)
    assert merged == latest
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    tb = read_tensorboard(tmp_path)
    assert tb.keys() == latest.keys()
    for step in tb:
        assert tb[step].keys() == latest[step].keys()
        assert all(tb[step][t] == pytest.approx(v, rel=1e-6) for t, v in latest[step].items())


def broken_jsonl_dir(tmp_path: Path) -> Path:
    """A logdir whose metrics.jsonl is /dev/full: opening works, every write fails with ENOSPC."""
    logdir = tmp_path / "full"
    logdir.mkdir()
    (logdir / "metrics.jsonl").symlink_to("/dev/full")
    return logdir


def test_failing_backend_warns_once_and_training_continues_bitwise(tmp_path):
    reference = models.mlp()
    ref_opt = torch.optim.Adam(reference.groups, lr=1e-2)
    steps(reference, ref_opt, 0, 4)
    problem = models.mlp()
    opt = Monitored(torch.optim.Adam)(problem.groups, lr=1e-2, monitor=MonitorConfig(
        backend="jsonl,tensorboard", logdir=broken_jsonl_dir(tmp_path)))
    with pytest.warns(RuntimeWarning, match=r"the jsonl backend failed .*No space left") as record:
        steps(problem, opt, 0, 4)
    assert sum("backend failed" in str(w.message) for w in record) == 1
    opt.monitor.close()
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(problem.named, reference.named))
    assert sorted(read_tensorboard(tmp_path / "full")) == [1, 2, 3, 4]  # the healthy backend kept going


def test_wandb_exception_is_reported_and_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "not-a-mode")
    problem = models.mlp()
    opt = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, monitor=MonitorConfig(backend="wandb,jsonl",
                                                                                   logdir=tmp_path))
    with pytest.warns(RuntimeWarning, match="the wandb backend failed"):
        steps(problem, opt, 0, 2)
    opt.monitor.close()
    assert sorted(read_jsonl(tmp_path)) == [1, 2]


@pytest.mark.parametrize("how", ["config", "environment"])
def test_strict_mode_raises(how, tmp_path, monkeypatch):
    problem = models.mlp()
    if how == "environment":
        monkeypatch.setenv("MONITORED_OPTIM_STRICT", "1")
        config = MonitorConfig(backend="jsonl", logdir=broken_jsonl_dir(tmp_path))
    else:
        config = MonitorConfig(backend="jsonl", logdir=broken_jsonl_dir(tmp_path), strict=True)
    opt = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, monitor=config)
    with pytest.raises(OSError, match="No space left"):
        steps(problem, opt, 0, 1)


def test_bad_strict_value_is_rejected(monkeypatch):
    monkeypatch.setenv("MONITORED_OPTIM_STRICT", "maybe")
    with pytest.raises(ValueError, match="MONITORED_OPTIM_STRICT='maybe'"):
        Monitored(torch.optim.SGD)(models.mlp().groups, lr=0.1)


def test_logdir_that_cannot_be_created_fails_at_construction(tmp_path):
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "run"
    with pytest.raises(OSError, match=str(bad)):
        Monitored(torch.optim.SGD)(models.mlp().groups, lr=0.1, monitor=MonitorConfig(backend="jsonl", logdir=bad))


@pytest.mark.parametrize("death", ["exception", "sigint", "sigint, started ignoring it"])
def test_a_run_that_dies_keeps_every_completed_logging_step(death, tmp_path):
    """A run killed by an exception or by Ctrl-C (its own SIGINT) keeps every completed logging step.

    The child raises KeyboardInterrupt on SIGINT whatever its parent ignored (the suite run as a
    background job passes SIGINT ignored down): the case tests the monitor, not how pytest was started."""
    kill = ('raise RuntimeError("loss exploded")' if death == "exception"
            else "import os, signal; os.kill(os.getpid(), signal.SIGINT)")
    script = textwrap.dedent(f"""
        import signal, sys, torch
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive run has it
        sys.path.insert(0, {str(TESTS)!r})
        import models
        from monitored_optim import Monitored, MonitorConfig
        problem = models.mlp()
        opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=MonitorConfig(
            backend="jsonl,tensorboard", logdir={str(tmp_path)!r}))
        for i in range(100):
            opt.zero_grad(); problem.loss(i).backward(); opt.step()
            if i == 4:
                {kill}
    """)
    command = [sys.executable, "-c", script]
    if death.endswith("ignoring it"):
        # as a shell without job control starts a background job (`pytest ... &` in a script): SIGINT
        # ignored, which exec keeps
        command = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', *command]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stderr
    assert ("loss exploded" if death == "exception" else "KeyboardInterrupt") in out.stderr
    assert sorted(read_jsonl(tmp_path)) == [1, 2, 3, 4, 5]
    assert sorted(read_tensorboard(tmp_path)) == [1, 2, 3, 4, 5]


def test_two_optimizers_with_the_same_tags_in_one_logdir_are_warned_about(tmp_path):
    config = MonitorConfig(backend="jsonl", logdir=tmp_path)
    first = Monitored(torch.optim.SGD)(models.mlp().groups, lr=0.1, monitor=config)
    with pytest.warns(UserWarning, match="give each one MonitorConfig\\(prefix=...\\)"):
        Monitored(torch.optim.SGD)(models.mlp().groups, lr=0.1, monitor=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Monitored(torch.optim.SGD)(models.mlp().groups, lr=0.1, monitor=MonitorConfig(
            backend="jsonl", logdir=tmp_path, prefix="other"))
    assert first.monitor.step == 0


def test_names_stay_when_the_base_load_state_dict_drops_them(tmp_path):
    """bitsandbytes' ``load_state_dict`` replaces the param groups with the loaded ones, without
    the ``param_names`` of ``named_parameters()``: the monitored class keeps each group's names (as
    torch's own ``load_state_dict`` does), so a resumed run logs under the same tags."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    plain = bnb.optim.AdamW(model.parameters(), lr=1e-3, optim_bits=32)
    opt = Monitored(bnb.optim.AdamW)(model.named_parameters(), lr=1e-3, optim_bits=32,
                                     monitor=MonitorConfig(backend="none", logdir=tmp_path))
    for optimizer in (plain, opt):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    opt.load_state_dict(plain.state_dict())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert {t.split("/", 1)[1] for t in opt.monitor.latest if t.startswith("update_norm/")} == \
        {"0.weight", "0.bias", "1.weight", "1.bias"}

"""Backends write what the monitor computed: TensorBoard event files (read back with the
``tensorboard`` package) and the offline W&B run (read back from its files) agree with
``metrics.jsonl``; files are complete at interpreter exit without an explicit close."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import models
from monitored_optim import Monitored, MonitorConfig
from wandb_files import read_metric_definitions, read_monitor_rows, read_rows


def read_jsonl(logdir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    return {row.pop("step"): row for row in rows}


def read_tensorboard(logdir: Path) -> dict[int, dict[str, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out


def train(backend: str, logdir: Path, steps: int = 6, every: int = 2):
    problem = models.mlp()
    opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=MonitorConfig(
        backend=backend, logdir=logdir, every=every))
    for i in range(steps):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()
    return opt


def offline_run(root: Path, teardown: bool = True) -> Path:
    """The one offline run under ``root``; ``teardown`` first shuts wandb's service down so that the
    file of a run the test itself finished is complete (``run.finish()`` can return before
    wandb-core has written the transaction log)."""
    if teardown:
        wandb.teardown()
    (run_dir,) = (root / "wandb").glob("offline-run-*")
    return run_dir


MONITOR_FAMILIES = ("update_to_data/*", "grad_to_data/*", "update_norm/*", "grad_norm/*", "param_norm/*",
                    "global/*", "lr/*", "health/*")


def assert_same(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], rel: float) -> None:
    assert a.keys() == b.keys()
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for tag, value in a[step].items():
            assert b[step][tag] == pytest.approx(value, rel=rel, abs=1e-30), (step, tag)


def test_tensorboard_and_wandb_agree_with_jsonl(tmp_path):
    opt = train("tensorboard,jsonl,wandb", tmp_path / "run")
    latest = dict(opt.monitor.latest)
    opt.monitor.close()
    jsonl = read_jsonl(tmp_path / "run")
    assert sorted(jsonl) == [2, 4, 6]
    assert jsonl[6] == latest
    assert "update_to_data/fc1.weight" in latest and "grad_to_data/fc2.bias" in latest
    assert "update_to_data/unused.weight" not in latest and "grad_norm/unused.weight" not in latest
    assert latest["update_norm/unused.weight"] == 0.0
    assert_same(jsonl, read_tensorboard(tmp_path / "run"), rel=1e-6)  # event files hold float32
    run_dir = offline_run(tmp_path, teardown=False)  # close() of its own run returns with the rows on disk
    assert_same(jsonl, read_monitor_rows(run_dir), rel=1e-12)
    definitions = read_metric_definitions(run_dir)
    assert definitions["optimizer/step"] == ""
    assert all(definitions[family] == "optimizer/step" for family in MONITOR_FAMILIES), definitions


@pytest.mark.parametrize("trial", range(3))
def test_own_wandb_run_is_complete_when_close_returns(trial, tmp_path):
    opt = train("wandb", tmp_path / "run", steps=8, every=1)
    opt.monitor.close()
    assert sorted(read_monitor_rows(offline_run(tmp_path, teardown=False))) == list(range(1, 9))


def test_active_wandb_run_is_reused_and_left_open(tmp_path):
    run = wandb.init(project="user-project")
    try:
        run.log({"user/loss": 1.0}, step=1)
        opt = train("wandb", tmp_path / "run", steps=4, every=1)
        opt.monitor.close()
        assert wandb.run is run
        run.log({"user/loss": 0.5}, step=5)
    finally:
        run.finish()
    rows = read_rows(offline_run(tmp_path))
    assert [row["user/loss"] for row in rows if "user/loss" in row] == [1.0, 0.5]
    assert sorted(read_monitor_rows(offline_run(tmp_path, teardown=False))) == [1, 2, 3, 4]


@pytest.mark.parametrize("user", ["hf-callback", "explicit-steps-ahead", "two-logs-per-iteration"])
def test_no_monitor_row_is_dropped_in_a_shared_run(user, tmp_path):
    """The user's run declares its own x axis and logs around the optimizer: as the Hugging Face
    callback does (``define_metric("*", step_metric="train/global_step", step_sync=True)``, rows
    with evaluation between them), with explicit ``step=`` values ahead of the optimizer's (which
    made W&B drop the monitor's rows when it logged with ``step=``), or twice per iteration
    without a step. Every monitor row is kept, at its own optimizer step."""
    run = wandb.init(project="user-project")
    if user == "hf-callback":
        run.define_metric("train/global_step")
        run.define_metric("*", step_metric="train/global_step", step_sync=True)
    problem = models.mlp()
    opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=MonitorConfig(
        backend="wandb", logdir=tmp_path / "run", every=1))
    for i in range(1, 21):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()
        if user == "hf-callback":
            run.log({"train/loss": 1.0 / i, "train/global_step": i})
            if i % 5 == 0:
                run.log({"eval/loss": 2.0, "train/global_step": i})
        elif user == "explicit-steps-ahead":
            run.log({"train/loss": 1.0 / i}, step=10 * i)
        else:
            run.log({"a": float(i)})
            run.log({"b": float(i)})
    latest = dict(opt.monitor.latest)
    opt.monitor.close()
    run.finish()
    rows = read_monitor_rows(offline_run(tmp_path))
    assert sorted(rows) == list(range(1, 21))
    assert {k: v for k, v in rows[20].items() if k in latest} == pytest.approx(latest, rel=1e-12)
    definitions = read_metric_definitions(offline_run(tmp_path, teardown=False))
    assert all(definitions[family] == "optimizer/step" for family in MONITOR_FAMILIES), definitions


def test_close_is_idempotent_and_jsonl_appends_one_object_per_step(tmp_path):
    opt = train("jsonl", tmp_path, steps=3, every=1)
    opt.monitor.close()
    opt.monitor.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_files_are_flushed_at_interpreter_exit(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import models
        from monitored_optim import Monitored
        problem = models.mlp()
        opt = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, momentum=0.9)
        for i in range(5):
            opt.zero_grad(); problem.loss(i).backward(); opt.step()
        print(opt.monitor.latest["update_to_data/fc1.weight"])
    """)
    env = {"PATH": "/usr/bin:/bin", "MONITORED_OPTIM_BACKEND": "tensorboard,jsonl",
           "MONITORED_OPTIM_LOGDIR": str(tmp_path / "run"), "MONITORED_OPTIM_EVERY": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    ratio = float(out.stdout.strip().splitlines()[-1])
    tb = read_tensorboard(tmp_path / "run")
    assert sorted(tb) == [1, 2, 3, 4, 5]
    assert tb[5]["update_to_data/fc1.weight"] == pytest.approx(ratio, rel=1e-6)
    assert read_jsonl(tmp_path / "run")[5]["update_to_data/fc1.weight"] == ratio

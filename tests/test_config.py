"""Configuration: environment variables, precedence, and clear errors at construction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from monitored_optim import Monitored, MonitorConfig
from monitored_optim.config import resolve


def build(**config):
    model = nn.Linear(2, 2)
    return Monitored(torch.optim.SGD)(model.named_parameters(), lr=0.1,
                                      monitor=MonitorConfig(**config) if config else None)


@pytest.mark.parametrize("var,value,allowed", [
    ("MONITORED_OPTIM_BACKEND", "tensorbord", "tensorboard, wandb, jsonl, mlflow, trackio, swanlab, comet, none"),
    ("MONITORED_OPTIM_BACKEND", "jsonl,foo", "tensorboard, wandb, jsonl, mlflow, trackio, swanlab, comet, none"),
    ("MONITORED_OPTIM_BACKEND", ",", "tensorboard, wandb, jsonl, mlflow, trackio, swanlab, comet, none"),
    ("MONITORED_OPTIM_EVERY", "0", "integer >= 1"),
    ("MONITORED_OPTIM_EVERY", "-3", "integer >= 1"),
    ("MONITORED_OPTIM_EVERY", "ten", "integer >= 1"),
    ("MONITORED_OPTIM_EVERY", "2.5", "integer >= 1"),
    ("MONITORED_OPTIM_COUNT", "steps", "updates, calls"),
    ("MONITORED_OPTIM_COMPILE", "maybe", "auto or one of 1, true, yes, on, 0, false, no, off"),
])
def test_bad_environment_raises_at_construction(monkeypatch, var, value, allowed):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as err:
        build()
    assert var in str(err.value) and repr(value) in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize("field,value,allowed", [
    ("backend", "tb", "tensorboard, wandb, jsonl, mlflow, trackio, swanlab, comet, none"),
    ("backend", ["jsonl", 3], "tensorboard, wandb, jsonl, mlflow, trackio, swanlab, comet, none"),
    ("backend", 123, "tensorboard, wandb, jsonl, mlflow, trackio, swanlab, comet, none"),
    ("backend", [], "tensorboard, wandb, jsonl, mlflow, trackio, swanlab, comet, none"),
    ("every", 0, "integer >= 1"),
    ("every", True, "integer >= 1"),
    ("every", 1.5, "integer >= 1"),
    ("every", "10", "integer >= 1"),
    ("strict", "yes", "True or False"),
    ("verify", 1, "True or False"),
    ("logdir", 3, "a path"),
    ("prefix", 7, "letters, digits"),
    ("count", "steps", "updates, calls"),
    ("count", 1, "updates, calls"),
    ("compile", "yes", "True, False or 'auto'"),
    ("compile", 1, "True, False or 'auto'"),
])
def test_bad_explicit_config_raises(field, value, allowed):
    with pytest.raises(ValueError) as err:
        build(**{field: value})
    assert f"MonitorConfig.{field}" in str(err.value) and allowed in str(err.value)


def test_environment_is_read(monkeypatch, tmp_path):
    monkeypatch.setenv("MONITORED_OPTIM_BACKEND", " JSONL , tensorboard ")
    monkeypatch.setenv("MONITORED_OPTIM_LOGDIR", str(tmp_path / "run"))
    monkeypatch.setenv("MONITORED_OPTIM_EVERY", "7")
    settings = build().monitor.settings
    assert settings.backends == ("jsonl", "tensorboard")
    assert settings.logdir == tmp_path / "run" and settings.every == 7


def test_explicit_config_wins_over_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MONITORED_OPTIM_BACKEND", "not-a-backend")
    monkeypatch.setenv("MONITORED_OPTIM_EVERY", "zero")
    monkeypatch.setenv("MONITORED_OPTIM_LOGDIR", "/elsewhere")
    settings = build(backend="none", every=3, logdir=tmp_path).monitor.settings
    assert settings.backends == () and settings.every == 3 and settings.logdir == tmp_path


def test_defaults_follow_tensorboard(monkeypatch):
    for var in ("MONITORED_OPTIM_BACKEND", "MONITORED_OPTIM_LOGDIR", "MONITORED_OPTIM_EVERY"):
        monkeypatch.delenv(var, raising=False)
    settings = resolve(None)
    assert settings.backends == ("tensorboard",) and settings.every == 10  # README, "Cost": why 10
    assert settings.logdir.parent == Path("runs")
    assert settings.logdir.name.endswith("_" + __import__("socket").gethostname())


def test_empty_variable_counts_as_unset(monkeypatch):
    monkeypatch.setenv("MONITORED_OPTIM_BACKEND", "")
    monkeypatch.setenv("MONITORED_OPTIM_EVERY", "  ")
    settings = resolve(None)
    assert settings.backends == ("tensorboard",) and settings.every == 10


def test_none_backend_alone_and_not_in_a_list():
    assert resolve(MonitorConfig(backend="none")).backends == ()
    with pytest.raises(ValueError, match="combines 'none' with other backends"):
        resolve(MonitorConfig(backend="none,jsonl"))


@pytest.mark.parametrize("source,value,want", [
    ("env", "1", "on"), ("env", "off", "off"), ("env", " AUTO ", "auto"), ("env", "", "auto"),
    ("field", True, "on"), ("field", False, "off"), ("field", "auto", "auto"), ("field", None, "auto"),
])
def test_compile_switch_reads_flags_and_auto(source, value, want, monkeypatch):
    """``MonitorConfig(compile=...)`` takes True, False or "auto"; the variable also takes the flag words."""
    if source == "env":
        monkeypatch.setenv("MONITORED_OPTIM_COMPILE", value)
        assert resolve(None).compile == want
    else:
        monkeypatch.setenv("MONITORED_OPTIM_COMPILE", "1")  # an explicit field wins over it
        assert resolve(MonitorConfig(compile=value)).compile == (want if value is not None else "on")

"""Test isolation: no network for W&B, no stray MONITORED_OPTIM_* settings from the caller's shell, and a
logging step at every optimizer step unless a test says otherwise."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch, tmp_path):
    for var in ("MONITORED_OPTIM_BACKEND", "MONITORED_OPTIM_LOGDIR", "MONITORED_OPTIM_EVERY", "MONITORED_OPTIM_COUNT",
                "MONITORED_OPTIM_STRICT", "MONITORED_OPTIM_VERIFY", "MONITORED_OPTIM_GUARD",
                "MONITORED_OPTIM_SKIP_BUDGET", "MONITORED_OPTIM_ALERTS", "MONITORED_OPTIM_STOP_ON"):
        monkeypatch.delenv(var, raising=False)
    # the tests count on a figure at every step unless they set `every`; the library's default period
    # (10) is tested in test_config.py, which resolves without this variable
    monkeypatch.setenv("MONITORED_OPTIM_EVERY", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _fresh_wandb_settings():
    """wandb caches its settings (WANDB_DIR, ...) process-wide at the first init; reset after each test."""
    yield
    import sys

    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


@pytest.fixture
def ray_cluster(monkeypatch):
    """A local Ray cluster for one test, sized for two Ray Train workers (``ScalingConfig(num_workers=2)``):
    two CPUs, no dashboard, a small object store (``TorchTrainer.fit()`` would otherwise start one with every
    core). Its processes inherit this process's environment as it is now (the MONITORED_OPTIM_* variables the
    test set); ``ray.shutdown()`` stops them after the test. Skipped without ``ray[train]``."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.train.torch")
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # the controller sees the workers end sooner
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20)
    yield ray
    ray.shutdown()

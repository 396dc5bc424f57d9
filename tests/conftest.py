"""Test isolation: no network for W&B, no stray MONITORED_OPTIM_* settings from the caller's shell."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch, tmp_path):
    for var in ("MONITORED_OPTIM_BACKEND", "MONITORED_OPTIM_LOGDIR", "MONITORED_OPTIM_EVERY", "MONITORED_OPTIM_COUNT",
                "MONITORED_OPTIM_STRICT", "MONITORED_OPTIM_VERIFY"):
        monkeypatch.delenv(var, raising=False)
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

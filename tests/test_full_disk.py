"""No backend can block or stop training: under a file-size limit (writes past it fail with EFBIG,
as on a full disk), a file backend is warned about once, naming it and the error, closed and
dropped, and every opt.step() returns promptly. Each case runs in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("full_disk_child.py")


def run_child(backend: str, tmp_path: Path, limit: int) -> tuple[list[str], str]:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb")}
    done = subprocess.run([sys.executable, "-W", "always", str(CHILD), backend, str(tmp_path / "run"), str(limit)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split(), done.stderr


@pytest.mark.parametrize("backend", ["tensorboard", "jsonl"])
def test_file_backend_past_the_size_limit_warns_once_and_training_goes_on(backend, tmp_path):
    (word, steps, slowest, closing), stderr = run_child(backend, tmp_path, 16384)
    assert (word, steps) == ("done", "60")
    failures = [line for line in stderr.splitlines() if "backend failed" in line]
    assert len(failures) == 1, stderr
    assert f"the {backend} backend failed" in failures[0] and "File too large" in failures[0]
    assert "unclosed file" not in stderr  # the dropped backend closed its file
    print(f"{backend}: slowest step {slowest} s, close {closing} s")


def test_wandb_past_the_size_limit_does_not_block(tmp_path):
    """W&B writes its files from its own service process, which reports its errors itself; the
    training process must still finish every step and close."""
    (word, steps, slowest, closing), stderr = run_child("wandb", tmp_path, 65536)
    assert (word, steps) == ("done", "60"), stderr
    print(f"wandb: slowest step {slowest} s, close {closing} s")

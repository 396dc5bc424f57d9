"""A script that never calls ``close()`` keeps every row of its W&B run, and no false warning, however
it ends: the script's end, Ctrl-C, a SIGTERM handler that raises SystemExit or one that closes the
monitor first. With Python's default SIGTERM handling the file backends keep every row. Each case is a
child process (``exit_child.py``) whose stderr and files are read back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_backends import read_jsonl, read_tensorboard
from wandb_files import read_exit_code, read_monitor_rows

CHILD = Path(__file__).with_name("exit_child.py")


def run_child(how: str, backends: str, tmp_path: Path) -> tuple[int, dict[str, float], str]:
    """Run ``exit_child.py`` in ``tmp_path`` to its end (sending SIGTERM once it has logged, for the
    ``sigterm`` ways): its exit status, the figures of its last step and its stderr."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    child = subprocess.Popen([sys.executable, str(CHILD), how, backends, str(tmp_path / "run")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:  # the figures' line, after what the trackers print
        line = next((out for out in iter(child.stdout.readline, "") if out.startswith("{")), "")
        if how.startswith("sigterm") and line:
            child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=120)
    finally:
        child.kill()
    assert line, stderr
    return child.returncode, json.loads(line), stderr


@pytest.mark.parametrize(("how", "status", "exit_code"), [
    ("end", 0, 0),
    ("ctrl-c", -signal.SIGINT, 255),  # W&B marks the run as failed, as for its own runs
    ("sigterm-exit", 128 + signal.SIGTERM, 128 + signal.SIGTERM),
    ("sigterm-close", 128 + signal.SIGTERM, 0),  # finished by the handler's close()
])
def test_wandb_run_keeps_every_row_without_a_warning_however_the_script_ends(how, status, exit_code, tmp_path):
    returncode, latest, stderr = run_child(how, "wandb", tmp_path)
    assert returncode == status, stderr
    assert "monitored_optim:" not in stderr
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = read_monitor_rows(run_dir)
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert rows[5] == pytest.approx(latest, rel=1e-12)
    assert read_exit_code(run_dir) == exit_code


def test_file_backends_keep_every_row_after_a_default_sigterm(tmp_path):
    """Python's default SIGTERM ends the process at once (no exit hooks): each row is already in
    ``metrics.jsonl`` and the TensorBoard event file, written unbuffered when it was logged."""
    returncode, latest, stderr = run_child("sigterm", "tensorboard,jsonl,wandb", tmp_path)
    assert returncode == -signal.SIGTERM, stderr
    assert "monitored_optim:" not in stderr
    jsonl = read_jsonl(tmp_path / "run")
    assert sorted(jsonl) == [1, 2, 3, 4, 5]
    assert jsonl[5] == latest
    tensorboard = read_tensorboard(tmp_path / "run")
    assert sorted(tensorboard) == [1, 2, 3, 4, 5]
    assert tensorboard[5] == pytest.approx(latest, rel=1e-6)

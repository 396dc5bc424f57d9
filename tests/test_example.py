"""The main job runs end to end: examples/digits.py trains, logs, and prints the ratio table."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.py"


def test_digits_example_trains_logs_and_prints_the_table(tmp_path):
    env = {**os.environ, "MONITORED_OPTIM_BACKEND": "jsonl,tensorboard", "MONITORED_OPTIM_LOGDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(EXAMPLE), "--epochs", "3"], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 3 * 23 + 1))  # 1,437 training images / 64 per batch
    window = rows[-20:]  # the table's rule, the report's: the median over the last 20 logged steps
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"):
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        median = statistics.median(row[f"update_to_data/{name}"] for row in window)
        assert abs(float(line.split()[1]) - median) <= 0.005, (line, median)
        assert ("not judged by the band" in line) == name.endswith(".bias")
    accuracy = float(out.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.8
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


def test_digits_example_names_the_wandb_run_directory_it_wrote(tmp_path):
    """With W&B offline, the closing lines give the run's own directory (under ``$WANDB_DIR/wandb/``)
    and the command that uploads it."""
    env = {**os.environ, "MONITORED_OPTIM_BACKEND": "wandb", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
           "WANDB_SILENT": "true"}
    out = subprocess.run([sys.executable, str(EXAMPLE), "--epochs", "1"], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("W&B run in "))
    run_dir = Path(line.removeprefix("W&B run in ").split(";")[0])
    assert run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    assert any(run_dir.glob("*.wandb")) and f"wandb sync {run_dir}" in line

"""Read the figures of a trackio, SwanLab or Comet run back from the tracker's own local store: trackio's
SQLite database, SwanLab's offline run file (``run-*.swanlab``, read with SwanLab's own reader), Comet's
offline archive (``messages.json`` in the zip). Each tracker is set up offline, under the test's tmp
directory, from its own environment variables, and opens, ends and reads runs as a user would."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest

TRACKIO_DIR = Path(tempfile.mkdtemp(prefix="monitored-optim-trackio-"))
os.environ.setdefault("TRACKIO_DIR", str(TRACKIO_DIR))  # trackio reads it once, when it is imported

OTHERS = ("user/", "train/")
"""The user's and the Hugging Face Trainer's metrics, which Comet may hold twice at one step (the
Trainer logs ``train/epoch`` again in its summary)."""

Rows = dict[int, dict[str, float]]
"""``{step: {metric name: value}}``: every point of a run."""


class Tracker:
    """One tracker in the tests: its backend name, the Hugging Face Trainer's ``report_to`` for it,
    and how a user opens and ends a run, and how its store is read."""

    name = report_to = ""

    def setup(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, project: str) -> None:
        """Configure the tracker offline, in ``tmp_path``, for ``project``."""

    def start(self):
        """Open a run as the user does: the run object."""

    def end(self, run) -> None:
        """End the user's run."""

    def active(self):
        """The tracker's active run, or None."""

    def runs(self, tmp_path: Path) -> list[Rows]:
        """Every run in the store: its points."""

    def cleanup(self) -> None:
        """End a run a failed test left open."""


class Trackio(Tracker):
    name = report_to = "trackio"

    def setup(self, monkeypatch, tmp_path, project):
        import trackio.utils

        assert Path(trackio.utils.TRACKIO_DIR) == Path(os.environ["TRACKIO_DIR"])
        self.project = _plain(project)
        monkeypatch.setenv("TRACKIO_PROJECT", self.project)

    def start(self):
        import trackio

        return trackio.init(project=self.project, embed=False, auto_log_cpu=False)

    def end(self, run):
        import trackio

        trackio.finish()

    def active(self):
        from trackio import context_vars

        return context_vars.current_run.get()

    def runs(self, tmp_path):
        from trackio.sqlite_storage import SQLiteStorage

        out = []
        for name in SQLiteStorage.get_runs(self.project):
            rows: Rows = {}
            for row in SQLiteStorage.get_logs(self.project, name):
                step, _ = row.pop("step"), row.pop("timestamp")
                assert not rows.get(step, {}).keys() & row.keys(), step  # no point written twice
                rows.setdefault(step, {}).update(row)
            out.append(rows)
        return out

    def cleanup(self):
        import sys

        if "trackio" in sys.modules and self.active() is not None:
            sys.modules["trackio"].finish()


class Swanlab(Tracker):
    name = report_to = "swanlab"

    def setup(self, monkeypatch, tmp_path, project):
        monkeypatch.setenv("SWANLAB_MODE", "offline")
        monkeypatch.setenv("SWANLAB_PROJ_NAME", _plain(project))
        for var in ("SWANLAB_LOG_DIR", "SWANLAB_LOGDIR"):
            monkeypatch.delenv(var, raising=False)

    def start(self):
        import swanlab

        return swanlab.init(log_dir="swanlog")  # in the test's working directory, its tmp_path

    def end(self, run):
        run.finish()

    def active(self):
        import swanlab

        return swanlab.get_run() if swanlab.has_run() else None

    def runs(self, tmp_path):
        """Each run's scalars; a row of the monitor's (SwanLab's own step) is keyed by the
        ``optimizer/step`` it carries, any other by its step."""
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record
        from swanlab.sdk.internal.core_python.store import DataStoreReader

        out, self.x_axes = [], {}  # and each metric's x axis ("" for SwanLab's step)
        for path in sorted(tmp_path.rglob("run-*.swanlab")):
            reader = DataStoreReader()
            reader.open(path)
            by_step: Rows = {}
            finished = False
            for data in reader:
                record = Record()
                record.ParseFromString(data)
                finished |= record.HasField("finish")
                if record.HasField("column"):
                    self.x_axes[record.column.column_key] = record.column.x_axis
                if record.HasField("scalar"):
                    point = by_step.setdefault(record.scalar.step, {})
                    assert record.scalar.key not in point, record.scalar.key  # no point written twice
                    point[record.scalar.key] = record.scalar.value.number
            reader.close()
            assert finished, path
            rows: Rows = {}
            for step, point in by_step.items():
                at = int(point.pop("optimizer/step")) if "optimizer/step" in point else step
                rows.setdefault(at, {}).update(point)
            out.append(rows)
        return out

    def cleanup(self):
        import sys

        if "swanlab" in sys.modules and self.active() is not None:
            self.active().finish()


class Comet(Tracker):
    name, report_to = "comet", "comet_ml"

    def setup(self, monkeypatch, tmp_path, project):
        monkeypatch.setenv("COMET_START_ONLINE", "false")
        # nothing reaches a network: no reports to Comet's error tracker, no look-up of its server's address
        monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "false")
        monkeypatch.setenv("COMET_AUTO_LOG_ENV_DETAILS", "false")
        monkeypatch.setenv("COMET_AUTO_LOG_ENV_HOST", "false")
        monkeypatch.setenv("COMET_PROJECT_NAME", _plain(project))
        monkeypatch.delenv("COMET_OFFLINE_DIRECTORY", raising=False)
        monkeypatch.delenv("COMET_API_KEY", raising=False)

    def start(self):
        import comet_ml

        return comet_ml.start(experiment_config=comet_ml.ExperimentConfig(offline_directory="cometml"))

    def end(self, run):
        run.end()

    def active(self):
        import comet_ml

        running = comet_ml.get_running_experiment()
        return running if running is not None and running.alive else None

    def runs(self, tmp_path):
        out = []
        for path in sorted(tmp_path.rglob("*.zip")):
            with zipfile.ZipFile(path) as archive:
                lines = archive.read("messages.json").decode().splitlines()
            rows: Rows = {}
            for message in map(json.loads, lines):
                metric = message["payload"].get("metric") if message["type"] == "metric_msg" else None
                # not Comet's own
                if metric and metric["step"] is not None and not metric["metricName"].startswith("sys."):
                    point = rows.setdefault(metric["step"], {})
                    assert metric["metricName"] not in point or metric["metricName"].startswith(OTHERS), metric
                    point[metric["metricName"]] = metric["metricValue"]
            out.append(rows)
        return out

    def cleanup(self):
        import sys

        if "comet_ml" in sys.modules and self.active() is not None:
            self.active().end()


def _plain(name: str) -> str:
    """A test's name as a project name every tracker takes: letters, digits, ``_`` and ``-``."""
    return re.sub(r"[^\w-]", "-", name).strip("-")


TRACKERS = {tracker.name: tracker for tracker in (Trackio(), Swanlab(), Comet())}


def remove_trackio_dir() -> None:
    shutil.rmtree(TRACKIO_DIR, ignore_errors=True)

"""A real TensorBoard server on a run directory, for tests that query the HTTP API its web page uses."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str, **query):
    """The JSON answer of the server at ``port`` to ``path?query``."""
    url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def tensorboard():
    """Start a real TensorBoard on a directory; yields ``start(logdir, runs) -> port`` (returning once
    the scalars of every run in ``runs`` are served); stopped after."""
    started = []

    def start(logdir: Path, runs: set[str]) -> int:
        port = free_port()
        command = shutil.which("tensorboard", path=str(Path(sys.executable).parent))
        started.append(subprocess.Popen([command, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port),
                                         "--reload_interval", "1"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for _ in range(120):  # until it has read every run (a minute at most)
            try:
                if runs <= set(get(port, "/data/plugin/scalars/tags")):
                    return port
            except OSError:
                pass
            assert started[-1].poll() is None, started[-1].stderr.read().decode()
            time.sleep(0.5)
        raise AssertionError("TensorBoard did not serve the runs in a minute")

    yield start
    for process in started:
        process.kill()
        process.wait()
        process.stderr.close()

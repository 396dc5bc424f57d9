"""One run directory across processes: a run killed in the middle of a row and resumed stays readable
(metrics.jsonl and TensorBoard event files); a second live process that would write to the directory writes
its own run beside it, warned about once, naming the first; a process that ended, even killed, leaves nothing
to warn about."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import models
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.__main__ import main
from monitored_optim.report import ReportError, load_run

CHILD = Path(__file__).with_name("run_dir_child.py")
SHARED = "another process"
"""Words of the warning about a second process writing to a run directory."""


def child_env(logdir: Path, backend: str) -> dict[str, str]:
    return {**os.environ, "MONITORED_OPTIM_BACKEND": backend, "MONITORED_OPTIM_LOGDIR": str(logdir)}


def run_child(logdir: Path, start: int, steps: int, mode: str = "plain",
              backend: str = "jsonl") -> subprocess.CompletedProcess:
    """Run run_dir_child.py to its end; its step axis continues from ``start``."""
    return subprocess.run([sys.executable, str(CHILD), str(start), str(steps), mode], capture_output=True,
                          text=True, timeout=180, env=child_env(logdir, backend))


def start_child(logdir: Path, start: int, steps: int, mode: str = "plain", backend: str = "jsonl",
                stderr: object = subprocess.PIPE) -> subprocess.Popen:
    """Start run_dir_child.py; stdin and stdout are pipes (``hold``: it says ``logged`` and waits)."""
    return subprocess.Popen([sys.executable, str(CHILD), str(start), str(steps), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=child_env(logdir, backend))


def rows(logdir: Path) -> tuple[list[dict], list[str]]:
    """The whole rows of ``metrics.jsonl`` in file order, and the lines that are not JSON (cut rows)."""
    whole, cut = [], []
    for line in (logdir / "metrics.jsonl").read_text().split("\n"):
        if line:
            try:
                whole.append(json.loads(line))
            except ValueError:
                cut.append(line)
    return whole, cut


def assert_reads_every_row(logdir: Path, whole: list[dict], capsys) -> None:
    """The report exits 0 on ``logdir`` and ``load_run`` holds every figure of ``whole`` at its step."""
    assert main(["report", str(logdir)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    want: dict[str, dict[int, float]] = {}
    for row in whole:
        step = row["step"]
        for tag, value in row.items():
            if tag != "step":
                want.setdefault(tag, {})[step] = value
    run = load_run(logdir)
    assert run.source == "jsonl"
    assert run.steps == sorted({row["step"] for row in whole})
    assert {tag: run.values(tag) for tag in run.series} == want


# ---- a run killed in the middle of a row, then resumed ---------------------------------------------

def test_a_run_resumed_after_a_row_cut_by_a_kill_stays_readable(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "update_to_data/w": -3.0}\n{"step": 2, "upd')
    resumed = run_child(run, 1, 3)
    assert resumed.returncode == 0, resumed.stderr
    whole, cut = rows(run)
    assert cut == ['{"step": 2, "upd']
    assert [row["step"] for row in whole] == [1, 2, 3, 4]
    assert_reads_every_row(run, whole, capsys)


def test_runs_killed_mid_row_and_while_logging_then_resumed_stay_readable(tmp_path, capsys):
    run = tmp_path / "run"
    # 1: a file-size limit cuts a row (a full disk does the same); the next write kills the process
    first = run_child(run, 0, 50, "limit=6000")
    assert first.returncode == -signal.SIGXFSZ, first.stderr
    whole, cut = rows(run)
    assert len(cut) == 1 and len(whole) >= 2 and (run / "metrics.jsonl").stat().st_size == 6000
    # 2: resumed at its last whole row, then SIGKILLed while it logs a row every step
    with open(tmp_path / "second.err", "w") as err:
        second = start_child(run, whole[-1]["step"], 10 ** 6, stderr=err)
        deadline = time.monotonic() + 120
        while len(rows(run)[0]) < len(whole) + 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        second.kill()
        second.wait(timeout=60)
    assert second.returncode == -signal.SIGKILL
    # 3: resumed again at the last whole row
    whole, cut = rows(run)
    third = run_child(run, whole[-1]["step"], 3)
    assert third.returncode == 0, third.stderr
    whole, cut = rows(run)
    assert [row["step"] for row in whole] == list(range(1, len(whole) + 1))  # every step once, in order
    assert 1 <= len(cut) <= 2  # the row the limit cut, and the one the SIGKILL may have cut
    assert SHARED not in (tmp_path / "second.err").read_text() + third.stderr  # the killed held no lock
    assert_reads_every_row(run, whole, capsys)


def test_a_tensorboard_run_killed_mid_record_and_resumed_stays_readable(tmp_path):
    run = tmp_path / "run"
    first = start_child(run, 0, 3, "hold", backend="tensorboard,jsonl")
    assert first.stdout.readline() == "logged\n"
    first.kill()
    first.communicate(timeout=60)
    (events,) = run.glob("events.out.tfevents.*")
    with open(events, "r+b") as file:
        file.truncate(events.stat().st_size - 10)  # step 3's record cut in the middle
    resumed = run_child(run, 2, 3, backend="tensorboard,jsonl")  # from its checkpoint at step 2
    assert resumed.returncode == 0, resumed.stderr
    assert "kept apart" in resumed.stderr  # metrics.jsonl holds step 3: the resumed run is written beside it
    for run_dir, steps in ((run, [1, 2]), (run / "run2", [3, 4, 5])):  # the killed run's step 3 cut in its events
        (run_dir / "tb").mkdir()
        for events in run_dir.glob("events.out.tfevents.*"):
            shutil.copy(events, run_dir / "tb")
        from_events, from_jsonl = load_run(run_dir / "tb"), load_run(run_dir)
        assert from_events.steps == steps and from_jsonl.steps == steps + ([3] if run_dir == run else [])
        assert from_events.series.keys() == from_jsonl.series.keys()
        for tag, points in from_events.series.items():
            assert [v for _, v in points] == pytest.approx([from_jsonl.values(tag)[s] for s, _ in points], rel=1e-6)


def test_every_cut_of_a_row_is_skipped_and_other_bad_lines_are_errors(tmp_path):
    row = json.dumps({"step": 12, 'update_to_data/h.0."q\\"k\u00e9': -2.5e-07, "global/grad_norm": 1e+20,
                      "health/no_grad": 2})
    after = json.dumps({"step": 13, "global/grad_norm": 0.5})
    for end in range(1, len(row)):
        (tmp_path / "metrics.jsonl").write_text(f"{row}\n{row[:end]}\n{after}\n")
        run = load_run(tmp_path)
        assert run.steps == [12, 13] and run.values("global/grad_norm") == {12: 1e20, 13: 0.5}, row[:end]
    for bad in ["not json", row + "}", row + after, '"step": 12}', "\0\0\0\0", "{" + row[9:-4], row[:-1] + "]"]:
        for text in (f"{row}\n{bad}\n{after}\n", f"{row}\n{bad}"):
            (tmp_path / "metrics.jsonl").write_text(text)
            with pytest.raises(ReportError, match=":2: corrupt line"):
                load_run(tmp_path)


@pytest.mark.parametrize("text, written", [
    ("", ""),
    ('{"step": 1, "global/grad_norm": 0.5}\n', '{"step": 1, "global/grad_norm": 0.5}\n'),
    ('{"step": 1, "global/grad_norm": 0.5}\n{"step": 2, "glo', '{"step": 1, "global/grad_norm": 0.5}\n'
                                                                '{"step": 2, "glo\n'),
])
def test_the_jsonl_backend_starts_its_rows_on_a_line_of_their_own(tmp_path, text, written):
    from monitored_optim.backends.jsonl import JsonlBackend

    (tmp_path / "metrics.jsonl").write_text(text)
    backend = JsonlBackend(tmp_path)
    backend.log({"global/grad_norm": 0.25}, 3)
    backend.log({"global/grad_norm": 0.125}, 4)
    backend.close()
    assert (tmp_path / "metrics.jsonl").read_text() == written + ('{"step": 3, "global/grad_norm": 0.25}\n'
                                                                  '{"step": 4, "global/grad_norm": 0.125}\n')


# ---- two processes on one run directory --------------------------------------------------------------

def test_a_second_process_on_a_run_directory_is_warned_once_naming_the_first(tmp_path):
    run = tmp_path / "run"
    first = start_child(run, 0, 1, "hold")
    assert first.stdout.readline() == "logged\n"
    second = run_child(run, 5, 2, "two")  # two monitors with prefixes: one warning for the process
    _, first_err = first.communicate("", timeout=120)
    after = run_child(run, 1, 1)  # the first has finished: a resumed run, not a second writer
    assert first.returncode == second.returncode == after.returncode == 0, second.stderr + after.stderr
    told = [line for line in second.stderr.splitlines() if SHARED in line]
    assert len(told) == 1, second.stderr
    assert repr(str(run)) in told[0] and f"pid {first.pid} on {socket.gethostname()}" in told[0]
    assert repr(str(run / "run2")) in told[0]  # its steps would continue the first's, but it is another run
    assert SHARED not in first_err + after.stderr
    assert [row["step"] for row in rows(run)[0]] == [1, 2]
    assert [row["step"] for row in rows(run / "run2")[0]] == [6, 6, 7, 7]  # a/ and b/ at each step


def test_a_forked_worker_does_not_keep_the_lock_of_a_killed_process(tmp_path):
    run = tmp_path / "run"
    killed = run_child(run, 0, 1, "fork")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    worker = int(killed.stdout)
    try:
        os.kill(worker, 0)  # the worker lives on, holding whatever the killed process left open in it
        assert lock_is_free(run)
    finally:
        os.kill(worker, signal.SIGKILL)


def lock_is_free(logdir: Path) -> bool:
    """Whether another open of the run directory's lock file could take it now."""
    with open(logdir / ".monitored_optim.lock", "a") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(file, fcntl.LOCK_UN)
        return True


def train(logdir: Path, prefix: str | None = None, steps: int = 2):
    problem = models.mlp()
    opt = Monitored(torch.optim.SGD)(problem.groups, lr=0.1, monitor=MonitorConfig(
        backend="jsonl,tensorboard", logdir=logdir, prefix=prefix))
    for i in range(steps):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()
    return opt


def test_monitors_of_one_process_share_its_lock_until_the_last_lets_go(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = train(tmp_path, "gen")
        assert (tmp_path / ".monitored_optim.lock").read_text() == f"{os.getpid()} {socket.gethostname()}\n"
        disc = train(tmp_path, "disc")
        gen.monitor.close()
        assert not lock_is_free(tmp_path)
        train(tmp_path, "gen").monitor.close()  # reopened and closed again while disc still writes
        assert not lock_is_free(tmp_path)
        del disc  # dropped without close: it lets go when collected
        gc.collect()
        assert lock_is_free(tmp_path)
    assert not [w for w in caught if SHARED in str(w.message)]


def test_a_lock_file_that_cannot_be_made_is_skipped_silently(tmp_path):
    (tmp_path / ".monitored_optim.lock").mkdir()  # not a file: cannot be opened or locked
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = train(tmp_path, steps=3)
        opt.monitor.close()
    assert not [w for w in caught if "monitored_optim: parameter" not in str(w.message)], caught
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

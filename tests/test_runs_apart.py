"""A run is never mixed into another: a run whose steps go back below those a log directory already
holds (a new run, or a resume from an earlier checkpoint) writes its files in a run directory of its own
beside them (``run2``, ``run3``, ...), which TensorBoard shows as a run of its own and the report reads
apart; a resume that continues the steps appends to the files it continues."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

import models
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.__main__ import main
from monitored_optim.report import load_histograms, load_run

APART = "kept apart"
"""Words of the warning that a run's files go to a run directory of their own."""


def train(logdir: Path, start: int, steps: int, backend: str = "jsonl,tensorboard",
          figures: str | None = None) -> dict[int, dict[str, float]]:
    """Train the tests' MLP with a monitored AdamW logging every step to ``logdir``, its step axis continuing
    from ``start`` (0: a new run); the figures of each logged step, as ``opt.monitor.latest`` had them."""
    problem = models.mlp()
    opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=MonitorConfig(
        backend=backend, logdir=logdir, every=1, exclude="unused.*", figures=figures))
    opt.monitor.step = start
    logged = {}
    for i in range(steps):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()
        logged[opt.monitor.step] = dict(opt.monitor.latest)
    opt.monitor.close()
    return logged


def quiet(logdir: Path, start: int, steps: int, **options) -> dict[int, dict[str, float]]:
    """:func:`train`, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return train(logdir, start, steps, **options)


def apart(logdir: Path, start: int, steps: int, into: Path, **options) -> dict[int, dict[str, float]]:
    """:func:`train`, expecting the one warning that its files go to ``into``, kept apart."""
    with pytest.warns(UserWarning, match=APART) as caught:
        logged = train(logdir, start, steps, **options)
    (told,) = [w for w in caught if APART in str(w.message)]
    assert repr(str(logdir)) in str(told.message) and repr(str(into)) in str(told.message)
    return logged


def rows(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir``'s ``metrics.jsonl``, in file order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_holds(run_dir: Path, logged: dict[int, dict[str, float]]) -> None:
    """``run_dir``'s ``metrics.jsonl`` holds exactly the rows ``logged``, steps strictly increasing, and
    the report reads them back."""
    assert rows(run_dir) == [{"step": step, **figures} for step, figures in logged.items()]
    run = load_run(run_dir)
    assert run.steps == list(logged)
    assert {tag: points[-1][1] for tag, points in run.series.items()} == logged[max(logged)]


def event_steps(logdir: Path, tag: str = "global/grad_norm") -> dict[str, list[int]]:
    """TensorBoard's runs under ``logdir`` (``.`` for the logdir itself) and the steps of ``tag`` in each."""
    multiplexer = EventMultiplexer(size_guidance={"scalars": 0})
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    return {run: [event.step for event in multiplexer.Scalars(run, tag)] for run in multiplexer.Runs()}


def test_two_runs_into_one_directory_read_back_apart(tmp_path, capsys):
    logdir = tmp_path / "exp"
    first = quiet(logdir, 0, 5)
    second = apart(logdir, 0, 3, logdir / "run2")
    assert_holds(logdir, first)
    assert_holds(logdir / "run2", second)
    assert json.loads((logdir / "params.json").read_text()) == json.loads((logdir / "run2/params.json").read_text())
    assert event_steps(logdir) == {".": [1, 2, 3, 4, 5], "run2": [1, 2, 3]}  # TensorBoard: two runs
    assert main(["report", str(logdir)]) == 0
    out = capsys.readouterr().out
    assert "steps 1-5" in out and "run2" in out  # the later run is named
    assert main(["report", str(logdir / "run2")]) == 0
    assert "steps 1-3" in capsys.readouterr().out


def test_a_resume_that_continues_the_steps_appends_to_the_same_files(tmp_path):
    first = quiet(tmp_path, 0, 3)
    resumed = quiet(tmp_path, 3, 3)
    assert_holds(tmp_path, {**first, **resumed})
    assert event_steps(tmp_path) == {".": [1, 2, 3, 4, 5, 6]}
    assert not (tmp_path / "run2").exists()


def test_a_resume_from_an_earlier_checkpoint_is_written_apart(tmp_path):
    first = quiet(tmp_path, 0, 6)
    resumed = apart(tmp_path, 3, 2, tmp_path / "run2")  # the run went on to step 6 after the checkpoint at 3
    assert_holds(tmp_path, first)
    assert_holds(tmp_path / "run2", resumed)
    assert event_steps(tmp_path) == {".": [1, 2, 3, 4, 5, 6], "run2": [4, 5]}


def test_each_later_writer_goes_to_the_run_its_steps_continue_or_to_a_new_one(tmp_path):
    a = quiet(tmp_path, 0, 4)
    b = apart(tmp_path, 0, 2, tmp_path / "run2")
    a.update(quiet(tmp_path, 4, 1))  # A resumed at its last step: it continues A, not B
    b.update(quiet(tmp_path, 2, 1))  # B resumed: it continues B, not A
    c = apart(tmp_path, 0, 1, tmp_path / "run3")
    for run_dir, logged in ((tmp_path, a), (tmp_path / "run2", b), (tmp_path / "run3", c)):
        assert_holds(run_dir, logged)
    assert event_steps(tmp_path) == {".": [1, 2, 3, 4, 5], "run2": [1, 2, 3], "run3": [1]}


def test_the_histograms_of_a_later_run_are_written_with_its_figures(tmp_path):
    quiet(tmp_path, 0, 3, backend="jsonl", figures="default,histograms")
    apart(tmp_path, 0, 2, tmp_path / "run2", backend="jsonl", figures="default,histograms")
    assert load_histograms(tmp_path).steps == [1, 2, 3]
    assert load_histograms(tmp_path / "run2").steps == [1, 2]


@pytest.mark.parametrize("backend", ["jsonl", "tensorboard"])
def test_each_backend_alone_keeps_a_new_run_apart(tmp_path, backend):
    quiet(tmp_path, 0, 3, backend=backend)
    apart(tmp_path, 0, 2, tmp_path / "run2", backend=backend)
    assert len(load_run(tmp_path).steps) == 3 and load_run(tmp_path / "run2").steps == [1, 2]


def test_a_damaged_last_row_is_passed_over(tmp_path):
    first = quiet(tmp_path, 0, 3, backend="jsonl")
    with open(tmp_path / "metrics.jsonl", "a") as file:
        file.write('{"step": 4, "update_to_da')  # a row cut by a kill: the file holds step 3
    resumed = quiet(tmp_path, 3, 2, backend="jsonl")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[:3] + lines[4:]] == [1, 2, 3, 4, 5]
    assert load_run(tmp_path).steps == [1, 2, 3, 4, 5]
    assert load_run(tmp_path).values("global/grad_norm") == {
        step: figures["global/grad_norm"] for step, figures in {**first, **resumed}.items()}


@pytest.mark.parametrize("damage", [b"\0\xff garbage, not a row\n", b"[1, 2]\n{\"step\": true}\n", b"x" * 300000,
                                    b'{"step": 99999999999999999999999999}\n'])
def test_a_file_with_no_row_to_read_holds_no_step_and_is_appended_to(tmp_path, damage):
    (tmp_path / "metrics.jsonl").write_bytes(damage)
    logged = quiet(tmp_path, 0, 2, backend="jsonl")
    assert (tmp_path / "metrics.jsonl").read_bytes().startswith(damage)
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text(errors="replace")
            .splitlines()[-2:]] == [{"step": step, **figures} for step, figures in logged.items()]
    assert not (tmp_path / "run2").exists()


def test_other_writers_event_files_and_damaged_ones_count_no_step(tmp_path):
    from tensorboardX import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:  # the user's own scalars, on another axis, in the same logdir
        writer.add_scalar("loss", 0.5, global_step=1000)
    (tmp_path / "events.out.tfevents.0.damaged").write_bytes(b"\x05\0\0\0\0\0\0\0garbage" * 10)
    (tmp_path / "events.out.tfevents.1.huge").write_bytes(b"\xff" * 20)  # a length beyond the file
    logged = quiet(tmp_path, 0, 2, backend="tensorboard")
    assert event_steps(tmp_path) == {".": list(logged)}


def test_a_name_taken_by_something_else_is_passed_over(tmp_path):
    quiet(tmp_path, 0, 2)
    (tmp_path / "run2").write_text("not a directory")
    second = apart(tmp_path, 0, 1, tmp_path / "run3")
    assert_holds(tmp_path / "run3", second)
    assert main(["report", str(tmp_path)]) == 0

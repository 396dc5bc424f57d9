"""The report on hostile or damaged input: each case either reads as the README says (exit 0 and the
table) or fails with one short line on stderr and exit status 1, never a traceback."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from monitored_optim.__main__ import main

ERROR = "monitored-optim: error: "
LONGEST = 300
"""Characters an error line may take (the run directory is ``run``, so nothing here is a long path)."""
ROOT = Path(__file__).resolve().parents[1]

GOOD = '{"step": 1, "update_to_data/fc1.weight": -3.0, "global/grad_norm": 0.5}\n'
DEEP = 100_000
"""Nesting levels of the deep cases: beyond any recursion limit."""


def deep(opening: str, closing: str, levels: int = DEEP) -> str:
    return opening * levels + "1" + closing * levels


def report(*args: str, capfd) -> tuple[int, str, str]:
    """``main(["report", *args])`` in this process: (exit status, stdout, stderr with a line for each
    warning, which the command line would print there)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["report", *args])
    out, err = capfd.readouterr()
    return code, out, err + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)


def cli(*args: str, cwd: Path) -> tuple[int, str, str]:
    """The real command line in a child process: (exit status, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "monitored_optim", "report", *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=180)
    return out.returncode, out.stdout, out.stderr


def assert_one_line(result: tuple[int, str, str], *words: str) -> None:
    """Exit status 1 and exactly one short stderr line saying ``words``."""
    code, _, err = result
    assert "Traceback" not in err, err[-2000:]
    assert code == 1, err[:500]
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err[:1000]
    assert lines[0].startswith(ERROR), lines[0][:500]
    assert len(lines[0]) <= LONGEST, f"{len(lines[0])} characters: {lines[0][:500]}"
    for word in words:
        assert word in lines[0]


def assert_table(result: tuple[int, str, str], *names: str) -> list[str]:
    """Exit status 0, nothing on stderr, and a table whose rows name ``names`` in order; returns the rows."""
    code, out, err = result
    assert "Traceback" not in err, err[-2000:]
    assert code == 0 and err == "", err[:1000]
    rows = [line for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [row.split()[1] for row in rows] == list(names), out[:2000]
    return rows


def write_run(tmp_path: Path, metrics: str | bytes | None = GOOD, params: str | bytes | None = None) -> str:
    """``run/metrics.jsonl`` and ``run/params.json`` under ``tmp_path`` (``None``: no such file)."""
    run = tmp_path / "run"
    run.mkdir()
    for name, content in (("metrics.jsonl", metrics), ("params.json", params)):
        if isinstance(content, str):
            (run / name).write_text(content, encoding="utf-8")
        elif content is not None:
            (run / name).write_bytes(content)
    return "run"


def rows(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


# ---- metrics.jsonl: read as the README says --------------------------------------------------------

READABLE = {
    # non-finite values are left out: the figure that has only those gets no row
    "nan and infinity tokens": GOOD + '{"step": 2, "update_to_data/fc1.weight": NaN, "update_to_data/fc2.weight": '
                                      'Infinity, "grad_to_data/fc2.weight": -Infinity}\n',
    "a float beyond float64 is infinite": GOOD.replace("}", ', "update_to_data/fc2.weight": 1e999}'),
    "an integer beyond float64 is infinite": GOOD.replace("}", ', "update_to_data/fc2.weight": 1' + "0" * 400 + "}"),
    "a negative one": GOOD.replace("}", ', "update_to_data/fc2.weight": -1' + "0" * 400 + "}"),
    "blank lines around": "\n \n" + GOOD + "\n\t\n",
    "a UTF-8 byte order mark": "\ufeff" + GOOD,
    "a cut last row": GOOD + '{"step": 2, "update_to_data/fc1.weight": -2.',
}


@pytest.mark.parametrize("content", READABLE.values(), ids=READABLE)
def test_readable_metrics(tmp_path, capfd, content):
    out = report(write_run(tmp_path, content), capfd=capfd)
    (row,) = assert_table(out, "fc1.weight")
    assert "-3.00" in row
    assert "fc2.weight" not in out[1] and "1000000" not in out[1]


def test_huge_tag_names_are_cut_to_the_width(tmp_path, capfd):
    """A parameter's and a global figure's name of a million characters: the row and the figure are
    shown, shortened in the middle like any long name, in the 80 columns of a pipe."""
    name = "w" * 1_000_000 + ".weight"
    out = report(write_run(tmp_path, GOOD.replace("}", f', "update_to_data/{name}": -2.5, "global/{name}": 1.5}}')),
                 capfd=capfd)
    _, row = assert_table(out, "fc1.weight", "…" + "w" * 26 + ".weight")
    assert "-2.50" in row
    lines = out[1].splitlines()
    assert max(map(len, lines)) <= 80
    assert lines[-1] == "   …" + "w" * 60 + ".weight 1.5"


# ---- metrics.jsonl: one line ----------------------------------------------------------------------

HUGE = "x" * 50_000_000
BIG = "x" * 1_000_000
DEEP_LINE = '{"step": 2, "update_to_data/fc1.weight": ' + deep("[", "]") + "}\n"

FAILING = {
    "a deep list value": ('{"step": 1, "update_to_data/fc1.weight": ' + deep("[", "]") + "}\n", ":1: corrupt line"),
    "a deep object value": ('{"step": 1, "a": ' + deep('{"a": ', "}") + "}\n", ":1: corrupt line"),
    "a deep line after a good one": (GOOD + DEEP_LINE, ":2: corrupt line"),
    "a deep line between good ones": (GOOD + DEEP_LINE + GOOD.replace('"step": 1', '"step": 3'), ":2: corrupt line"),
    # no row the monitor writes is nested: a deep line is no row cut short, however it ends
    "a deep last line, cut": (GOOD + '{"step": 2, "update_to_data/fc1.weight": ' + "[" * DEEP, ":2: corrupt line"),
    "a deep last object, cut": (GOOD + '{"step": 2, "a": ' + '{"a": ' * DEEP, ":2: corrupt line"),
    "a 50 MB string value": ('{"step": 1, "update_to_data/fc1.weight": "' + HUGE + '"}\n', "not a number"),
    "a huge string step": ('{"step": "' + BIG + '", "update_to_data/fc1.weight": -3.0}\n', '"step" is'),
    "a huge tag with a bad value": ('{"step": 1, "update_to_data/' + "w" * 1_000_000 + '": "x"}\n', "not a number"),
    "a huge tag of another writer": ('{"step": 1, "' + "t" * 1_000_000 + '": 1.0}\n', "only other writers' tags"),
    "a huge list value": ('{"step": 1, "global/grad_norm": [' + ", ".join(["1.5"] * 1_000_000) + "]}\n",
                          "not a number"),
    "a huge object value": ('{"step": 1, "global/grad_norm": {' + ", ".join(f'"k{i}": {i}' for i in range(200_000))
                            + "}}\n", "not a number"),
    **{f"a step {what}": (GOOD.replace('"step": 1', f'"step": {step}'), '"step" is') for what, step in [
        ("beyond 64 bits", "1" + "0" * 400), ("below 64 bits", "-1" + "0" * 400), ("as a string", '"1"'),
        ("as a float", "1.0"), ("as a bool", "true"), ("as null", "null"), ("as NaN", "NaN")]},
    "a step of 5000 digits": (GOOD.replace('"step": 1', '"step": 1' + "0" * 5000), ":1: corrupt line"),
    "no step": ('{"update_to_data/fc1.weight": -3.0}\n', '"step" is'),
    **{f"a value as {what}": (GOOD.replace("0.5", value), "not a number") for what, value in [
        ("an object", '{"value": 0.5}'), ("a list", "[0.5]"), ("a string", '"0.5"'), ("a bool", "false"),
        ("null", "null")]},
    "a list line": ("[1, 2]\n", "not an object"),
    "a number line": ("3\n", "not an object"),
    "a string line": ('"' + BIG + '"\n', "not an object"),
    "a null line": ("null\n", "not an object"),
    "an empty file": ("", "no logged steps"),
    "only blank lines": ("\n\n   \n\t\n", "no logged steps"),
    "only non-finite values": ('{"step": 1, "update_to_data/fc1.weight": NaN, "global/grad_norm": Infinity}\n',
                               "no monitored_optim figures"),
    "not UTF-8": (GOOD.encode() + b'{"step": 2, "\xff\xfe": 1.0}\n', "cannot read"),
    "NUL bytes": (GOOD + "\x00\x00\x00\n", ":2: corrupt line"),
    "JSON with comments": (GOOD + "// a comment\n", ":2: corrupt line"),
    "two objects on a line": (GOOD.strip() + GOOD, ":1: corrupt line"),
}


@pytest.mark.parametrize("content, words", FAILING.values(), ids=FAILING)
def test_failing_metrics(tmp_path, capfd, content, words):
    assert_one_line(report(write_run(tmp_path, content), capfd=capfd), "run/metrics.jsonl", words)


@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_and_random_text(tmp_path, capfd, seed):
    generator = random.Random(seed)
    garbage = generator.randbytes(4096)
    assert_one_line(report(write_run(tmp_path, garbage), capfd=capfd), "run/metrics.jsonl")
    text = "".join(generator.choice('{}[]":,. \n0123456789-eE+stepNaIfinity') for _ in range(4096)) + "\n"
    (tmp_path / "run" / "metrics.jsonl").write_text(text)
    assert_one_line(report("run", capfd=capfd), "run/metrics.jsonl")
    (tmp_path / "run" / "metrics.jsonl").write_bytes(GOOD.encode() + garbage)  # garbage after a good line
    assert_one_line(report("run", capfd=capfd), "run/metrics.jsonl")


def test_metrics_jsonl_that_is_a_directory(tmp_path, capfd):
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    assert_one_line(report("run", capfd=capfd), "run/metrics.jsonl", "cannot read")


# ---- params.json: optional metadata, ignored when it is not what the monitor writes ----------------

PARAMS = {
    "deep list": deep("[", "]"),
    "deep object": deep('{"a": ', "}"),
    "deep kind": '{"fc1.weight": {"kind": ' + deep("[", "]") + "}}",
    "a list": '[{"kind": "vector"}]',
    "a number": "3",
    "a string": '"vector"',
    "null": "null",
    "an empty file": "",
    "values that are not objects": '{"fc1.weight": 3, "fc2.weight": "vector", "fc3.weight": null}',
    "a value that is a list": '{"fc1.weight": ["kind", "vector"]}',
    "no kind": '{"fc1.weight": {"shape": [3, 4]}}',
    "a kind that is a number": '{"fc1.weight": {"kind": 1}}',
    "a kind that is a list": '{"fc1.weight": {"kind": ["vector"]}}',
    "a kind that is an object": '{"fc1.weight": {"kind": {"vector": true}}}',
    "a kind that is null": '{"fc1.weight": {"kind": null}}',
    "a kind of 5000 digits": '{"fc1.weight": {"kind": 1' + "0" * 5000 + "}}",
    "a huge kind": '{"fc1.weight": {"kind": "' + BIG + '"}}',
    "NaN": '{"fc1.weight": NaN}',
    "not UTF-8": b'{"fc1.weight": {"kind": "\xff"}}',
    "random bytes": random.Random(0).randbytes(4096),
    "cut": '{"fc1.weight": {"kind": "vec',
}


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS)
def test_hostile_params_json_is_ignored(tmp_path, capfd, params):
    (row,) = assert_table(report(write_run(tmp_path, params=params), capfd=capfd), "fc1.weight")
    assert "vector" not in row  # the kind is guessed from the name: a weight is a matrix


def test_params_json_that_is_a_directory_is_ignored_and_a_good_one_read(tmp_path, capfd):
    run = write_run(tmp_path)
    (tmp_path / run / "params.json").mkdir()
    assert_table(report(run, capfd=capfd), "fc1.weight")
    (tmp_path / run / "params.json").rmdir()
    (tmp_path / run / "params.json").write_text('{"fc1.weight": {"kind": "vector"}}')
    (row,) = assert_table(report(run, capfd=capfd), "fc1.weight")
    assert row.rstrip().endswith("vector")


# ---- the real command line -------------------------------------------------------------------------

CHILD = {
    "a deep metrics line": ('{"step": 1, "update_to_data/fc1.weight": ' + deep("[", "]") + "}\n", None,
                            ":1: corrupt line"),
    "a 50 MB string value": ('{"step": 1, "update_to_data/fc1.weight": "' + HUGE + '"}\n', None, "not a number"),
    "a step beyond 64 bits": (GOOD.replace('"step": 1', '"step": 1' + "0" * 400), None, '"step" is'),
    "a deep params.json": (GOOD, deep("[", "]"), None),
}


@pytest.mark.parametrize("metrics, params, words", CHILD.values(), ids=CHILD)
def test_the_command_line_on_deep_and_huge_input(tmp_path, metrics, params, words):
    out = cli(write_run(tmp_path, metrics, params), "--plot", "lines.png", "--heatmap", "heat.png", cwd=tmp_path)
    if words is None:
        assert_table(out, "fc1.weight")
        assert (tmp_path / "lines.png").stat().st_size > 0 and (tmp_path / "heat.png").stat().st_size > 0
    else:
        assert_one_line(out, "run/metrics.jsonl", words)
        assert out[1] == "" and not (tmp_path / "lines.png").exists()


# ---- TensorBoard event files -----------------------------------------------------------------------

def event_file(tmp_path: Path) -> bytes:
    """The bytes of a real event file: three parameters' ratios and a global norm over five steps."""
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "written"))
    for step in range(1, 6):
        for name in ("fc1.weight", "fc1.bias", "fc2.weight"):
            writer.add_scalar(f"update_to_data/{name}", -3.0 + step / 10, step)
        writer.add_scalar("global/grad_norm", 1.0 / step, step)
    writer.close()
    (file,) = (tmp_path / "written").glob("events.out.tfevents.*")
    return file.read_bytes()


def test_damaged_event_files(tmp_path, capfd):
    """A cut file is read up to its last whole record (as a cut ``metrics.jsonl`` line is skipped), as
    is one with a damaged record; one with nothing readable fails in one line."""
    whole = event_file(tmp_path)
    (tmp_path / "run").mkdir()
    events = tmp_path / "run" / "events.out.tfevents.1.host"
    generator = random.Random(0)
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0xFF
    readable = [(whole, 5), (whole[:-1], 5), (whole[:len(whole) // 2], 3), (bytes(flipped), 3),
                (whole + generator.randbytes(512), 5)]  # whole, cut in its last record, in half, damaged, garbage after
    for content, steps in readable:
        events.write_bytes(content)
        out = report("run", capfd=capfd)
        assert_table(out, "fc1.weight", "fc1.bias", "fc2.weight")
        assert out[1].startswith(f"run  (tensorboard, {steps} logged steps, last step {steps})")
    for content in (whole[:60], whole[:10], b"", generator.randbytes(4096), b"\x00" * 4096, b"\xff" * 4096):
        events.write_bytes(content)
        assert_one_line(report("run", capfd=capfd), "run: ", "TensorBoard event files")
    events.unlink()
    events.mkdir()  # an event "file" that is a directory: no event files
    assert_one_line(report("run", capfd=capfd), "run", "found no metrics.jsonl and no TensorBoard event files")


# ---- the plots -------------------------------------------------------------------------------------

def test_plots_of_a_run_with_only_nan_ratios_and_of_a_single_step(tmp_path, capfd):
    nan_ratios = rows(*({"step": s, "update_to_data/fc1.weight": float("nan"), "global/grad_norm": 0.5}
                        for s in (1, 2, 3)))
    run = write_run(tmp_path, nan_ratios)
    assert_table(report(run, "--plot", "lines.png", capfd=capfd))  # no ratio: no row, but a plot
    assert (tmp_path / "lines.png").stat().st_size > 0
    assert_one_line(report(run, "--heatmap", "heat.png", capfd=capfd), "run", "no update-to-data ratios")

    (tmp_path / run / "metrics.jsonl").write_text(rows({"step": 1, "update_to_data/fc1.weight": float("nan")}))
    assert_one_line(report(run, "--plot", "x.png", "--heatmap", "y.png", capfd=capfd), "no monitored_optim figures")
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "y.png").exists()

    (tmp_path / run / "metrics.jsonl").write_text(GOOD)
    assert_table(report(run, "--plot", "one.png", "--heatmap", "one_heat.png", capfd=capfd), "fc1.weight")
    assert (tmp_path / "one.png").stat().st_size > 0 and (tmp_path / "one_heat.png").stat().st_size > 0


EXTREME = {
    # a span beyond float64: matplotlib cannot lay the axes out
    "the largest floats": (rows({"step": 1, "update_to_data/fc1.weight": 1.7976931348623157e308,
                                 "update_to_data/fc2.weight": -1.7976931348623157e308,
                                 "global/grad_norm": 1.7976931348623157e308, "global/update_norm": 5e-324},
                                {"step": 2, "update_to_data/fc1.weight": -3.0, "update_to_data/fc2.weight": 5e-324,
                                 "global/grad_norm": 5e-324, "global/update_norm": 1.7976931348623157e308}), False),
    "steps at the ends of 64 bits": (rows({"step": -2**63, "update_to_data/fc1.weight": -3.0, "global/grad_norm": 1.0},
                                          {"step": 0, "update_to_data/fc1.weight": -2.0},
                                          {"step": 2**63 - 1, "update_to_data/fc1.weight": -4.0}), True),
    "a huge tag name": (GOOD.replace("}", ', "update_to_data/' + "w" * 100_000 + '": -2.5}'), True),
}


@pytest.mark.parametrize("metrics, drawn", EXTREME.values(), ids=EXTREME)
def test_plots_of_extreme_figures(tmp_path, capfd, metrics, drawn):
    """Extreme but readable figures: each plot is written, or refused in one line where matplotlib
    cannot draw the figures; no warning either way."""
    run = write_run(tmp_path, metrics)
    for flag, path in (("--plot", "lines.png"), ("--heatmap", "heat.png")):
        result = report(run, flag, path, capfd=capfd)
        if drawn:
            assert result[0] == 0 and result[2] == "" and result[1].endswith(f"written to {path}\n"), result[2][:500]
            assert (tmp_path / path).stat().st_size > 0
        else:
            assert_one_line(result, f"{path}: cannot draw the plot")

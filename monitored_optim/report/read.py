"""Read a run back: ``{run_dir}/metrics.jsonl`` or the TensorBoard event files in ``run_dir``.

Both sources become one :class:`Run`: for every tag, its (step, value) points in step order, and the
tags in *layer order*, the order they were first logged in. Within one logging step the monitor
emits a parameter's figures in the optimizer's parameter order, so first-appearance order is the
optimizer's parameter order.

Sources and their order:

- ``metrics.jsonl`` (JSONL backend): exact float64 values; tags ordered by first appearance in the
  file (JSON objects keep their key order). Preferred when both sources exist.
- TensorBoard event files (``events.out.tfevents.*`` written by the TensorBoard backend): float32
  values, read with ``tensorboard``'s ``EventAccumulator``; tags ordered by the first step at which
  they were logged, ties broken by the order the reader returns them, which is the order they were
  written (``EventAccumulator`` keeps tags in insertion order). The sort is stable, so the order is
  reproducible whatever reader version is installed.

Runs apart: a later run whose steps went back below those of the run in a directory is written in a
directory of its own inside it (``run2``, ``run3``, ...: :mod:`monitored_optim.backends.rundir`);
:func:`load_run` reads the files of the directory it is given, and ``Run.later`` names those later runs.

Restarts within one directory (an optimizer that loads an earlier checkpoint while it logs, or files written
before runs were kept apart): when a tag is logged at a step not after its previous point, that tag's points
at that step and later are dropped and the new ones kept, as TensorBoard does for out-of-order steps
("purge orphaned data", per tag). Writers with disjoint tags in one directory merge.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..backends.rundir import EVENTS, METRICS, later_runs
from ..grouping import STATS
from ..tags import is_series, split as split_tag
from .errors import ReportError, quote, reason, require

EXPECTED = "a run directory with metrics.jsonl or TensorBoard event files (events.out.tfevents.*)"


@dataclass
class Run:
    """A run read back from disk.

    Attributes:
        path: the run directory that was read.
        source: ``"jsonl"`` or ``"tensorboard"``, which files the figures came from.
        steps: every step at which the monitor logged (tags it writes, :func:`~monitored_optim.tags.split`;
            other writers' tags in the same directory, a trainer's loss, do not add steps), ascending
            (the x axis; ints >= 1).
        series: tag -> list of ``(step, value)`` pairs in ascending step order, the tags in layer
            order (first-appearance order, see the module docstring). Values are floats in the
            tag's unit (log10 of a ratio for ``update_to_data/``, L2 norms for ``*_norm``, ...).
    """

    path: Path
    source: str
    steps: list[int] = field(default_factory=list)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    """Parameter label -> ``"matrix"`` or ``"vector"``, from the run's ``params.json`` (empty for
    runs without one: older versions, W&B-only runs)."""
    later: list[Path] = field(default_factory=list)
    """The later runs kept apart in the run directory's ``run2``, ``run3``, ... (a run whose steps went back
    below this one's: :mod:`monitored_optim.backends.rundir`), each read by its own path."""

    def values(self, tag: str) -> dict[int, float]:
        """The points of ``tag`` as ``{step: value}``; empty when the tag was never logged."""
        return dict(self.series.get(tag, ()))


def load_run(run_dir: str | Path) -> Run:
    """Read the run in ``run_dir``, from ``metrics.jsonl`` if present, else from its event files.

    A later run kept apart in the run directory (``run2``: its steps went back below this one's) is not read
    with it: ``Run.later`` names it, and ``load_run`` of its path reads it.

    Returns:
        The :class:`Run`, with at least one logged step.

    Raises:
        ReportError: ``run_dir`` is missing or not a directory, holds neither source, or the
            source is unreadable, corrupt or holds no figures. The message is one line naming the
            path and what was expected.
        ReportError: reading event files needs the ``tensorboard`` package and it is missing (the
            message names ``pip install 'monitored_optim[report]'``).
    """
    path = Path(run_dir)
    if not path.exists():
        raise ReportError(f"{path}: no such directory; expected {EXPECTED}")
    if not path.is_dir():
        raise ReportError(f"{path}: not a directory; expected {EXPECTED}")
    jsonl = path / METRICS
    if jsonl.exists():
        run, where = _read_jsonl(path, jsonl), jsonl
    elif any(p.is_file() for p in path.glob(EVENTS)):
        run, where = _read_tensorboard(path), path
    else:
        raise ReportError(f"{path}: found no metrics.jsonl and no TensorBoard event files; "
                          f"expected {EXPECTED}{_hint_subdirectories(path)}")
    if not run.steps:
        other = f" (only other writers' tags, such as {quote(next(iter(run.series)))})" if run.series else ""
        raise ReportError(f"{where}: no monitored_optim figures in the {run.source} log{other}; expected {EXPECTED}")
    run.kinds = _read_kinds(path / "params.json")
    run.later = later_runs(path)
    return run


def _read_kinds(path: Path) -> dict[str, str]:
    """Label -> kind from ``params.json`` (written by the monitor); empty if missing, unreadable or not
    the monitor's shape (optional metadata: the kinds are then guessed from the names)."""
    try:
        described = json.loads(path.read_text(encoding="utf-8"))
        return {label: str(info["kind"]) for label, info in described.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return {}


def _hint_subdirectories(path: Path) -> str:
    """`` (runs found in subdirectories: a, b; pass one of them)`` when ``path`` is a parent of runs,
    up to three levels down (``lightning_logs/version_0`` inside a project directory)."""
    try:
        below = [d for pattern in ("*", "*/*", "*/*/*") for d in path.glob(pattern) if d.is_dir()]
        runs = sorted(d for d in below if (d / METRICS).exists() or any(d.glob(EVENTS)))
    except OSError:
        return ""
    if not runs:
        if (path / "wandb").is_dir():
            return (" (it holds a W&B run: W&B runs are read in W&B, `wandb sync` for an offline one; to also keep "
                    "a local copy for this report, log with MONITORED_OPTIM_BACKEND=wandb,jsonl)")
        return ""
    shown = ", ".join(str(d) for d in runs[:3]) + (", ..." if len(runs) > 3 else "")
    return f" (runs found in subdirectories: {shown}; pass one of them)"


def _read_jsonl(run_dir: Path, file: Path) -> Run:
    """Parse ``metrics.jsonl``: each line ``{"step": int, tag: number, ...}``.

    A row cut short (:func:`_is_cut`: its writer was killed in the middle of writing it, or a full
    disk cut the write; a run resumed later appends after it, on the next line) is ignored; any other
    malformed line raises :class:`ReportError` naming ``file:line``.
    """
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte order mark, if any, is no part of line 1
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{file}: cannot read ({reason(exc)}); expected {EXPECTED}") from None
    lines = text.split("\n")
    records: list[tuple[int, dict[str, float]]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(_parse_record(line))
        except ValueError as exc:
            if _is_cut(line):
                continue
            raise ReportError(f"{file}:{number}: corrupt line ({exc}); expected one JSON object "
                              f'per line like {{"step": 10, "update_to_data/fc1.weight": -2.97}}') from None
    if not records:
        raise ReportError(f"{file}: no logged steps in the file; expected {EXPECTED}")
    return assemble(run_dir, "jsonl", records)


ROW_START = '{"step": '
"""How every row of ``metrics.jsonl`` and ``histograms.jsonl`` begins (``json.dumps({"step": N, ...})``)."""
CUT_ENDINGS = tuple(a + b for a in ("", "0", '0000"', '""') for b in ("", ":0"))
"""Endings of which one, followed by the closing brackets still open, completes a row cut anywhere: after
a value nothing; after a colon, a comma in a list or within a number ``0``; after a key ``:0``; within a
key, a ``\\uXXXX`` escape too, ``0000":0``; after a comma or a key's backslash ``"":0``."""


def _is_cut(line: str) -> bool:
    """Whether ``line`` is the beginning of a row, cut short: it begins as every row does and one of
    :data:`CUT_ENDINGS` and the brackets it leaves open make it a JSON object. Garbage, two rows run
    together or a row with something added are not."""
    if not (line.startswith(ROW_START) or ROW_START.startswith(line)):
        return False
    closers = _open_brackets(line)
    for ending in CUT_ENDINGS:
        try:
            json.loads(line + ending + closers)
            return True
        except (ValueError, RecursionError):
            pass
    return False


def _open_brackets(line: str) -> str:
    """The closing brackets of those ``line`` leaves open outside strings, innermost first (``]}`` for
    ``{"a": [1``); ``}`` at least."""
    stack, in_string, escaped = [], False, False
    for char in line:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            stack.append("]" if char == "[" else "}")
        elif char in "]}" and stack:
            stack.pop()
    return "".join(reversed(stack)) or "}"


def _parse_record(line: str) -> tuple[int, dict[str, float]]:
    """``(step, {tag: value})`` from one JSONL line; ``ValueError`` saying what is wrong.

    The step is a 64-bit integer (as TensorBoard's); a value is a JSON number, one beyond float64's
    range infinite (as JSON's ``1e999`` reads), so left out like ``NaN``.
    """
    try:
        obj = json.loads(line)  # json.JSONDecodeError is a ValueError
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    step = obj.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not -2**63 <= step < 2**63:
        raise ValueError(f'"step" is {quote(step)}, not a 64-bit integer')
    figures = {}
    for tag, value in obj.items():
        if tag == "step":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{quote(tag)} is {quote(value)}, not a number")
        try:
            figures[tag] = float(value)
        except OverflowError:  # an integer beyond float64
            figures[tag] = math.inf if value > 0 else -math.inf
    return step, figures


def _read_tensorboard(run_dir: Path) -> Run:
    """Scalars of every event file in ``run_dir`` through ``EventAccumulator`` (all points kept)."""
    event_accumulator = require("tensorboard.backend.event_processing.event_accumulator", "tensorboard")
    try:
        acc = event_accumulator.EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        tags = list(acc.Tags().get("scalars", []))
        events = {tag: acc.Scalars(tag) for tag in tags}
    except Exception as exc:  # the reader raises assorted errors (DataLossError, OSError, ...)
        raise ReportError(f"{run_dir}: unreadable TensorBoard event files ({reason(exc)}); "
                          f"expected {EXPECTED}") from None
    tags = [t for t in tags if events[t]]
    if not tags:
        raise ReportError(f"{run_dir}: the TensorBoard event files hold no scalar figures; expected {EXPECTED}")
    first_step = {tag: min(e.step for e in events[tag]) for tag in tags}
    tags.sort(key=first_step.__getitem__)  # stable: ties keep the reader's (write) order
    records = [(int(e.step), {tag: float(e.value)}) for tag in tags for e in events[tag]]
    return assemble(run_dir, "tensorboard", records)


def assemble(run_dir: Path, source: str, records: list[tuple[int, dict[str, float]]]) -> Run:
    """Build a :class:`Run` from ``(step, figures)`` records in write order.

    Per tag, a point at a step not after that tag's previous point starts over: the tag's points at
    that step and later are dropped first (a restart in the same logdir). Several writers with
    different tags (two optimizers sharing a logdir) therefore merge without loss. Non-finite values
    are left out.
    """
    series: dict[str, dict[int, float]] = {}
    for step, figures in records:
        for tag, value in figures.items():
            points = series.setdefault(tag, {})
            if points and step <= next(reversed(points)):
                for old in [s for s in points if s >= step]:
                    del points[old]
            if math.isfinite(value):
                points[step] = value
    series = _depth_medians(series)
    steps = sorted({step for tag, points in series.items() if split_tag(tag) is not None
                    for step in points})  # a trainer's tags in the same logdir aside
    return Run(run_dir, source, steps, {tag: list(points.items()) for tag, points in series.items() if points})


def _depth_medians(series: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """``series`` with each depth group (:func:`~monitored_optim.grouping.summarize`'s tags, a logging
    step over the tag budget as TensorBoard got it) read as one parameter: ``update_to_data/h.*.w/median`` becomes
    ``update_to_data/h.*.w`` (the median over depth), and the group's other summaries (its min, max
    and their layer indices, which are no ratios) are left out."""
    out = {}
    for tag, points in series.items():
        parsed = split_tag(tag)
        name, _, stat = parsed[2].rpartition("/") if parsed else ("", "", "")
        if parsed and is_series(parsed[1]) and "*" in name and stat in STATS:
            if stat == "median":
                out[tag[:-len("/median")]] = points
            continue
        out[tag] = points
    return out

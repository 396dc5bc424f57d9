"""Which directory a run's files go to: the logdir, or a run directory of its own beside another run's.

A run directory holds one run's files (``metrics.jsonl``, ``histograms.jsonl``, ``params.json``, event files).
The writer of a process in a logdir (its monitors with file backends, from the first that opens them to the
last that closes) writes, from its first logging step F:

- to the logdir itself, when it holds no monitor figures yet;
- else to the run directory whose last step is the closest below F, the logdir's or a ``run<N>``'s beside it
  (a resume that continues a run's steps appends to that run's files);
- else, and when that directory is being written by another live process (:mod:`.lock`), to a new
  ``{logdir}/run<N>`` (``run2``, ``run3``, ...), said once in a warning naming it: a new run, a resume from
  an earlier checkpoint or a second process are never appended to another run's files. TensorBoard
  shows each directory as a run of its own (``exp1`` and ``exp1/run2``) and the report reads each apart.

A run directory's last step is the greatest step of the monitor's figures in it: that of the last whole row
of ``metrics.jsonl`` (read from the end of the file; a row cut short or damaged is passed over) and that of
the last record holding a monitor tag in each event file (the records of other writers on other axes, a
trainer's loss, and damaged ones are passed over). Monitors of one process share its choice while one of
them is open there (a GAN's two optimizers with tag prefixes).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .._warnings import warn
from ..tags import split
from . import lock

RUN = re.compile(r"run([1-9][0-9]*)")
"""The name of a later run's directory in its logdir: ``run2``, ``run3``, ..."""
METRICS = "metrics.jsonl"
"""The jsonl backend's file in a run directory."""
EVENTS = "events.out.tfevents.*"
"""The TensorBoard event files of a run directory, as a glob."""
BLOCK = 1 << 16
"""Bytes of ``metrics.jsonl`` read from its end at first when looking for its last row (doubled until one
whole row is in them)."""


@dataclass
class _Claim:
    """Where this process writes in a logdir: the run directory, its lock's descriptor (or None), and how
    many of its writers are open there."""

    where: Path
    fd: int | None
    count: int


_CLAIMS: dict[str, _Claim] = {}
"""Real path of a logdir -> this process's claim there."""


def claim(logdir: Path, step: int) -> Path:
    """The run directory in ``logdir`` of a writer of this process whose first logging step is ``step``: the
    one this process already writes there, else chosen (module docstring) and locked. Never raises."""
    key = os.path.realpath(logdir)
    taken = _CLAIMS.get(key)
    if taken is not None:
        taken.count += 1
        return taken.where
    where, fd = _place(logdir, step)
    _CLAIMS[key] = _Claim(where, fd, 1)
    return where


def release(logdir: Path) -> None:
    """Let one writer of this process in ``logdir`` go; the last one unlocks its run directory."""
    key = os.path.realpath(logdir)
    taken = _CLAIMS.get(key)
    if taken is None:
        return
    taken.count -= 1
    if taken.count == 0:
        del _CLAIMS[key]
        if taken.fd is not None:
            os.close(taken.fd)


def later_runs(logdir: Path) -> list[Path]:
    """The later runs' directories beside the logdir's own run (``run2``, ``run3``, ...), in number order."""
    try:
        found = [(int(match[1]), path) for path in logdir.iterdir()
                 if (match := RUN.fullmatch(path.name)) and int(match[1]) > 1 and path.is_dir()]
    except OSError:
        return []
    return [path for _, path in sorted(found)]


def last_step(run_dir: Path) -> int | None:
    """The greatest step of the monitor's figures in ``run_dir`` (module docstring); None where it holds none
    that can be read. Never raises."""
    try:
        steps = [_last_row(run_dir / METRICS), *map(_last_event, sorted(run_dir.glob(EVENTS)))]
    except OSError:
        return None
    return max((step for step in steps if step is not None), default=None)


def _place(logdir: Path, step: int) -> tuple[Path, int | None]:
    """The run directory of a writer whose first logging step is ``step``, and its lock (module docstring);
    a new one is warned about."""
    first = last_step(logdir)
    lasts = {logdir: first, **({run: last_step(run) for run in later_runs(logdir)} if first is not None else {})}
    busy = None
    for run, last in sorted(lasts.items(), key=lambda item: -1 if item[1] is None else item[1], reverse=True):
        if last is not None and last >= step:
            continue
        fd = lock.take(run)
        if not isinstance(fd, str):
            return run, fd
        busy = busy or (run, fd)
    new = _new_run(logdir)
    if busy is not None:
        why = f"another process ({busy[1]}) is logging to {str(busy[0])!r}"
    else:
        latest = max(last for last in lasts.values() if last is not None)
        why = (f"{str(logdir)!r} already holds a run logged up to step {latest}, and this one logs from step {step} "
               "(a new run, or a resume from an earlier checkpoint)")
    warn(f"monitored_optim: {why}: its files go to {str(new)!r}, kept apart, a run of its own for TensorBoard "
         "and the report; give each run its own logdir (MonitorConfig(logdir=...) or MONITORED_OPTIM_LOGDIR) "
         "to avoid this")
    fd = lock.take(new)
    return new, None if isinstance(fd, str) else fd


def _new_run(logdir: Path) -> Path:
    """A new run directory ``{logdir}/run<N>``, N after every later run's (made here, so that two processes
    never get the same one; where it cannot be made, the backends say why)."""
    number = max((int(run.name[3:]) for run in later_runs(logdir)), default=1)
    while True:
        number += 1
        new = logdir / f"run{number}"
        try:
            new.mkdir()
            return new
        except FileExistsError:
            continue
        except OSError:
            return new


def _last_row(path: Path) -> int | None:
    """The step of the last whole row of ``path`` (``metrics.jsonl``) that reads as one, read from the end of
    the file; None where there is none or no file."""
    try:
        with open(path, "rb") as file:
            end, block, rest = file.seek(0, os.SEEK_END), BLOCK, b""
            while end > 0:
                start = max(end - block, 0)
                file.seek(start)
                lines = (file.read(end - start) + rest).split(b"\n")
                rest = lines.pop(0) if start > 0 else b""  # a line begun before the block
                for line in reversed(lines):
                    step = _step(line)
                    if step is not None:
                        return step
                end, block = start, block * 2
    except OSError:
        pass
    return None


def _step(line: bytes) -> int | None:
    """The step of one row of ``metrics.jsonl`` (``{"step": 10, ...}``: a 64-bit integer, as the report reads
    it), or None for a line that is not one."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2 ** 63 else None


def _last_event(path: Path) -> int | None:
    """The step of the last whole record of the event file ``path`` that holds a monitor tag; None where none
    does, or the file cannot be read.

    The records' lengths lead from one to the next (a TFRecord: length, its CRC, the data, its CRC), so only
    their headers are read until the last, then records are parsed from the last back."""
    from tensorboardX.proto.event_pb2 import Event

    records = []
    try:
        with open(path, "rb") as file:
            size, offset = os.fstat(file.fileno()).st_size, 0
            while offset + 12 <= size:
                file.seek(offset)
                (length,) = struct.unpack("<Q", file.read(8))
                if offset + length + 16 > size:
                    break  # cut short, or not a record: what follows cannot be found
                records.append((offset + 12, length))
                offset += length + 16
            for start, length in reversed(records):
                file.seek(start)
                try:
                    event = Event.FromString(file.read(length))
                except Exception:  # protobuf's DecodeError: a damaged record
                    continue
                if any(split(value.tag) for value in event.summary.value):
                    return int(event.step)
    except OSError:
        pass
    return None


def _forget() -> None:
    """In a forked child: close the parent's lock descriptors; the child takes its own when it writes."""
    for taken in _CLAIMS.values():
        if taken.fd is not None:
            os.close(taken.fd)
    _CLAIMS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)

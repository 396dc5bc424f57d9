"""Read the history of an offline W&B run back from its ``run-*.wandb`` file.

The file is a LevelDB-style log (header ``<4sHB`` = ``b":W&B"``, 0xBEE1, version 0; 32 KiB blocks of
records with a 7-byte ``<IHB`` header: CRC32C, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4) whose
payloads are ``wandb.proto.wandb_internal_pb2.Record`` messages. wandb ships no reader for it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7


def _payloads(data: bytes):
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:
            pos += room
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            parts = [chunk]
        elif kind == 3:
            parts.append(chunk)
        elif kind == 4:
            parts.append(chunk)
            yield b"".join(parts)


def _records(run_dir: Path, kind: str):
    (path,) = Path(run_dir).glob("run-*.wandb")
    for payload in _payloads(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == kind:
            yield record


def read_rows(run_dir: Path) -> list[dict[str, float]]:
    """Every history row of the offline run under ``run_dir``, in order, with W&B's ``_step``."""
    rows = []
    for record in _records(run_dir, "history"):
        items = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
        rows.append({k: v for k, v in items.items() if k == "_step" or not k.startswith("_")})
    return rows


def read_monitor_rows(run_dir: Path, step_metric: str = "optimizer/step") -> dict[int, dict[str, float]]:
    """``{optimizer step: figures}`` of the monitor's rows (those carrying ``step_metric``)."""
    return {int(row.pop(step_metric)): {k: v for k, v in row.items() if k != "_step"}
            for row in read_rows(run_dir) if step_metric in row}


def read_metric_definitions(run_dir: Path) -> dict[str, str]:
    """``{name or glob: step metric}`` of every ``define_metric`` in the run."""
    return {(record.metric.name or record.metric.glob_name): record.metric.step_metric
            for record in _records(run_dir, "metric")}


def read_exit_code(run_dir: Path) -> int | None:
    """The exit code W&B recorded when the run finished, or ``None`` if it was never finished."""
    codes = [record.exit.exit_code for record in _records(run_dir, "exit")]
    return codes[-1] if codes else None

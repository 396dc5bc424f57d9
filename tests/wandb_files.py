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


def read_history(run_dir: Path) -> dict[int, dict[str, float]]:
    """``{step: {key: value}}`` of every ``run.log`` in the offline run under ``run_dir``."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    history: dict[int, dict[str, float]] = {}
    for payload in _payloads(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            items[key] = json.loads(item.value_json)
        step = items.pop("_step", record.history.step.num)
        history[int(step)] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history

"""TensorBoard backend: one event per logging step holding every figure, written in the caller's thread."""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c


class TensorBoardBackend:
    """Writes each logging step as one ``Summary`` event with a ``simple_value`` per tag, at
    ``step``, to an event file ``events.out.tfevents.<time>.<host><suffix>`` in ``logdir``.
    TensorBoard shows each tag as a scalar series, exactly as if ``SummaryWriter.add_scalar`` had
    been called per tag, which costs about 40x more on a few hundred tags (one event per tag).

    Each event is framed as a TFRecord (length, masked CRC-32C of the length, the serialized
    ``Event``, its masked CRC-32C: tensorboardX's ``RecordWriter`` format) and appended with one
    unbuffered ``write`` in the calling thread, so it is in the file when :meth:`log` returns and a
    full disk or a file-size limit raises ``OSError`` there, which the monitor reports once and
    survives. (``SummaryWriter`` hands events to a writer thread through a bounded queue: when that
    thread dies of ENOSPC, the queue fills and the next logging step blocks forever.)

    Example: ``TensorBoardBackend(Path("runs/exp1")).log({"global/grad_norm": 0.5}, step=10)``
    writes an event file that ``tensorboard --logdir runs`` shows.

    Raises:
        OSError: the event file cannot be created or written.
    """

    def __init__(self, logdir: Path, filename_suffix: str = "") -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}{filename_suffix}"
        self._file = open(os.path.join(str(logdir), name), "ab", buffering=0)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in metrics.items()]
        self._write(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        self._file.close()

    def _write(self, event: Event) -> None:
        data = event.SerializeToString()
        header = struct.pack("Q", len(data))
        self._file.write(header + struct.pack("I", masked_crc32c(header)) + data + struct.pack("I", masked_crc32c(data)))

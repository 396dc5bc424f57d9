"""TensorBoard backend: one event per logging step holding every figure, written in the caller's thread,
and a Custom Scalars layout with one chart per figure series."""

from __future__ import annotations

import os
import re
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import HistogramProto, Summary
from tensorboardX.record_writer import masked_crc32c
from tensorboardX.summary import custom_scalars

from ..histograms import Histogram
from ..tags import FAMILIES, family, split
from .bins import LIMITS, check, span

DBL_MAX = 1.7976931348623157e308
"""The right limit of a histogram's last bucket, as TensorFlow writes it (``std::numeric_limits<double>::max()``)."""


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

    The first :meth:`log` also writes the event file's Custom Scalars layout (:func:`layout`), so
    that TensorBoard's *Custom Scalars* tab shows each figure series of every layer in one chart.

    Example: ``TensorBoardBackend(Path("runs/exp1")).log({"global/grad_norm": 0.5}, step=10)``
    writes an event file that ``tensorboard --logdir runs`` shows.

    Raises:
        OSError: the event file cannot be created or written.
    """

    def __init__(self, logdir: Path, filename_suffix: str = "") -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        self._logdir = logdir
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}{filename_suffix}"
        self._file = open(os.path.join(str(logdir), name), "ab", buffering=0)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self._laid_out = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self._laid_out:
            self._write(Event(wall_time=time.time(), step=step, summary=layout(metrics, self._logdir)))
            self._laid_out = True
        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in metrics.items()]
        self._write(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def histograms(self, hists: dict[str, Histogram], step: int) -> None:
        """Write one event at ``step`` with a ``HistogramProto`` per tag (:func:`histogram`), for
        TensorBoard's *Histograms* and *Distributions* tabs; an empty histogram is left out."""
        values = [Summary.Value(tag=tag, histo=histogram(hist)) for tag, hist in hists.items() if any(hist)]
        self._write(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        self._file.close()

    def _write(self, event: Event) -> None:
        data = event.SerializeToString()
        header = struct.pack("Q", len(data))
        self._file.write(header + struct.pack("I", masked_crc32c(header))
                         + data + struct.pack("I", masked_crc32c(data)))


def histogram(hist: Histogram) -> HistogramProto:
    """The ``HistogramProto`` of a histogram of the fixed bins (:mod:`monitored_optim.histograms`).

    Only the span from the first to the last non-empty bin is written (TensorBoard drops empty
    outer buckets when it reads one anyway): ``bucket`` holds those counts and ``bucket_limit``
    each one's right edge, :data:`DBL_MAX` for the open last bin as TensorFlow writes it. ``min``,
    ``max``, ``sum`` and ``sum_squares`` are the exact ones of the elements counted, ``num`` their
    count; TensorBoard draws the first bucket from ``min`` and the last one to ``max``.

    Example: the histogram of ``[0.3, 0.7]`` is written with ``min=0.3, max=0.7, num=2, sum=1.0,
    sum_squares=0.58, bucket_limit=[0.5, 1.0], bucket=[1, 1]``.

    Raises:
        TypeError, ValueError: ``hist`` is not a :class:`~monitored_optim.histograms.Histogram` of
            :data:`~monitored_optim.histograms.NBINS` counts (:func:`~.bins.check`).
    """
    check(hist)
    start, stop = span(hist)
    kept = [float(c) for c in hist[start:stop]]
    return HistogramProto(min=hist.min, max=hist.max, num=sum(kept), sum=hist.sum, sum_squares=hist.sum_squares,
                          bucket_limit=[*LIMITS[start + 1:stop], LIMITS[stop] if stop < len(hist) else DBL_MAX],
                          bucket=kept)


_CHARTS: dict[str, dict[tuple[str, str], dict[str, list]]] = {}
"""Real path of a logdir -> the charts this process's writers there have laid out so far, by (prefix,
family): each writer's layout holds them all, since TensorBoard shows one layout per run directory
(two optimizers with prefixes sharing a logdir both get their charts)."""


def layout(tags: Iterable[str], logdir: Path | None = None) -> Summary:
    """The Custom Scalars layout of a run whose logging steps send ``tags``: a category per figure
    family (``[prefix/]norms``, in the order of :data:`~monitored_optim.tags.FAMILIES`), in it a
    multiline chart per series (``update_norm``) or run-wide head (``global``) present in ``tags``,
    drawing every tag of it; with ``logdir``, also the charts this process laid out there before.

    A chart names its tags by one regular expression, ``^{prefix}{series}/`` (TensorBoard matches it
    against the run's tags when the tab is opened), so it holds every layer, and over the tag budget
    every depth group's ``min``, ``median`` and ``max`` (``/argmin`` and ``/argmax``, layer indices,
    are left out) beside the parameters left ungrouped. The summary is tensorboardX's
    ``add_custom_scalars`` record: the tag ``custom_scalars__config__`` with a serialized ``Layout``.
    """
    charts = {} if logdir is None else _CHARTS.setdefault(os.path.realpath(logdir), {})
    for tag in tags:
        parts = split(tag)
        if parts is None:
            continue
        prefix, kind, _ = parts
        name = family(kind + "/_")
        assert name is not None  # split() parses only the tags the monitor writes, each of a family
        category = charts.setdefault((prefix, name), {})
        category.setdefault(f"{prefix}{kind}", ["Multiline", [rf"^{re.escape(prefix + kind)}/(?!.*/arg(min|max)$)"]])
    order = sorted(charts, key=lambda key: (key[0], FAMILIES.index(key[1]) if key[1] in FAMILIES else len(FAMILIES)))
    return custom_scalars({prefix + name: charts[prefix, name] for prefix, name in order})

"""SwanLab backend: the active SwanLab run if there is one, else a run of our own."""

from __future__ import annotations

import os
import re
from pathlib import Path

import swanlab

from .names import STEP_METRIC, Families, Keys, shorten

MAX_KEY = 512
"""The longest metric name SwanLab keeps (``METRIC_KEY_MAX_LENGTH``); it cuts longer ones."""

_REFUSED = re.compile(r"[\x00-\x1f\x7f]|^[ ./]|[ ./]$")
"""What SwanLab refuses in a metric name (control characters) or strips from its ends (spaces, ``.``, ``/``)."""


def swanlab_key(tag: str) -> str:
    """The SwanLab metric name of a monitor tag: ``tag`` itself where SwanLab keeps it as it is.

    A control character, or a space, ``.`` or ``/`` at either end, becomes ``_``; a name over
    :data:`MAX_KEY` characters keeps its beginning and end around 8 hex digits of the tag's SHA-1.
    """
    return shorten(_REFUSED.sub("_", tag), tag, MAX_KEY)


class SwanlabBackend:
    """Logs each step's figures as one SwanLab row carrying the optimizer step as ``optimizer/step``.

    The optimizer step is the x axis of the monitor's figures through SwanLab's convention for
    several x axes, as in W&B: ``define_metric("<family>/*", x_axis="optimizer/step")`` for each
    family of tags (``update_to_data``, ``global``, ..., or the monitor's ``prefix``). No ``step=``
    is passed, so the steps that a trainer gives its own rows (the Hugging Face Trainer's callback
    logs at ``step=state.global_step``) stay as they are. SwanLab writes from its own thread and
    reports its own failures on its console; it never stops the caller.

    The active run (``swanlab.has_run()``: the user's ``swanlab.init()``, the Hugging Face Trainer's
    with ``report_to="swanlab"``) is reused and left open at ``close``; otherwise ``swanlab.init()``
    starts one configured by SwanLab's own variables (``SWANLAB_MODE``: ``offline`` or ``local`` runs
    without a server; ``SWANLAB_PROJECT``, ...), and ``close`` finishes it (at interpreter exit
    without ``close``, the monitor's exit hook finishes it). Its files go to ``SWANLAB_LOG_DIR``
    when that is set, else to ``<logdir>/swanlog/``.

    Example: ``SwanlabBackend(Path("runs/exp1")).log({"global/grad_norm": 0.5}, step=10)``.
    """

    NO_HISTOGRAMS = "SwanLab has no histogram type: it logs scalars and media (images, audio, text, ECharts)"

    def __init__(self, logdir: Path) -> None:
        self._owned = not swanlab.has_run()
        if self._owned:
            chosen = os.environ.get("SWANLAB_LOG_DIR") or os.environ.get("SWANLAB_LOGDIR")
            self._run = swanlab.init(log_dir=None if chosen else str(logdir / "swanlog"))
        else:
            self._run = swanlab.get_run()
        self._key = Keys(swanlab_key, MAX_KEY)
        self._families = Families()

    def log(self, metrics: dict[str, float], step: int) -> None:
        figures = self._key.rename(metrics)
        for family in self._families.new(figures):
            self._run.define_metric(f"{family}/*", x_axis=STEP_METRIC)
        self._run.log({**figures, STEP_METRIC: step})

    def close(self) -> None:
        run, self._run = self._run, None
        if self._owned and run is not None and run.alive:
            run.finish()

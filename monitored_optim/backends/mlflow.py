"""MLflow backend: the active MLflow run if there is one, else a run of our own."""

from __future__ import annotations

import re
import time

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric

from .names import Keys, shorten

MAX_KEY = 250
"""The longest metric name MLflow accepts (``mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH``)."""

MAX_BATCH = 1000
"""The most metrics one ``log_batch`` request may carry (``MAX_METRICS_PER_BATCH``)."""

_REFUSED = re.compile(r"[^/\w.\- ]")
"""Characters MLflow refuses in a metric name: all but letters, digits, ``_ - .``, spaces and ``/``
(it also takes ``:``, except on Windows, so ``:`` is replaced too)."""


def metric_key(tag: str) -> str:
    """The MLflow metric name of a monitor tag: ``tag`` itself where MLflow takes it.

    A character MLflow refuses becomes ``_`` (``fc.weight@group1`` -> ``fc.weight_group1``, a depth
    group's ``h.*.attn`` -> ``h._.attn``); a path component it would read as a path (empty, ``.``,
    ``..``) becomes ``_``; a name over :data:`MAX_KEY` characters keeps its first 150 and last 90,
    joined by 8 hex digits of the tag's SHA-1, so that long names stay apart.
    """
    key = "/".join("_" if part in ("", ".", "..") else _REFUSED.sub("_", part) for part in tag.split("/"))
    return shorten(key, tag, MAX_KEY)


class MlflowBackend:
    """Logs each step's figures as MLflow metrics at the optimizer step.

    Each logging step is one ``MlflowClient.log_batch`` of ``Metric(key, value, timestamp, step)``
    (several above :data:`MAX_BATCH` figures), keys from :func:`metric_key` (a key that two tags
    would share gets ``-`` and 8 hex digits of the later tag's SHA-1). MLflow keeps a history per
    key, so the figures sit at their optimizer step next to a trainer's own metrics at its steps.

    The active run (``mlflow.active_run()``: the user's ``mlflow.start_run()``, the Hugging Face
    Trainer's MLflow callback, or Lightning's ``MLFlowLogger`` given that run's ``run_id``) is reused
    and left open at ``close``; otherwise ``mlflow.start_run()`` starts one configured by MLflow's
    own variables (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``, ...),
    which becomes the active run, and ``close`` ends it (at interpreter exit without ``close``,
    MLflow's own exit hook ends it). Given a ``run_id`` and its run's client (Lightning's
    ``MLFlowLogger``'s, which :class:`~monitored_optim.lightning.MonitorCallback` passes), it logs
    there without touching the active run, and leaves that run to its owner.

    Example: ``MlflowBackend().log({"global/grad_norm": 0.5}, step=10)``.

    Raises:
        mlflow.exceptions.MlflowException: the store refuses the run or its metrics.
    """

    NO_HISTOGRAMS = "MLflow has no histogram type: its metrics are single numbers"
    NAME = "mlflow"
    """The backend name this object stands for where it is given in ``MonitorConfig.backend``."""

    def __init__(self, run_id: str | None = None, client: MlflowClient | None = None) -> None:
        """``run_id``: the run to log into through ``client`` (default: an ``MlflowClient()``); None:
        the active run, or one of its own."""
        self._run_id: str | None = run_id
        if run_id is not None:
            self._owned = False
        else:
            active = mlflow.active_run()
            self._owned = active is None
            self._run_id = (mlflow.start_run() if active is None else active).info.run_id
        self._client = client if client is not None else MlflowClient()
        self._key = Keys(metric_key, MAX_KEY)

    def log(self, metrics: dict[str, float], step: int) -> None:
        run_id = self._run_id
        assert run_id is not None, "logged after close()"  # the Fanout drops a closed backend
        stamp = int(time.time() * 1000)
        batch = [Metric(self._key(tag), value, stamp, step) for tag, value in metrics.items()]
        for start in range(0, len(batch), MAX_BATCH):
            self._client.log_batch(run_id, metrics=batch[start:start + MAX_BATCH])

    def close(self) -> None:
        run_id, self._run_id = self._run_id, None
        active = mlflow.active_run()
        if self._owned and active is not None and active.info.run_id == run_id:
            mlflow.end_run()

"""What a run tells a person: warnings about the figures every rank shares, events, alerts and stops.

An event is something a person may want to act on (:data:`KINDS`). Events are found from the
reduced figures of a logging step (``nonfinite``, ``spikes``, ``unchanged``, ``no_grad``) or by the
guard at the step itself (``skipped``, ``stalled``). Every rank finds the same events at the same
step, since they come from figures or a decision reduced over the world: so a stop that an event asks
for (``MonitorConfig.stop_on``) holds on every rank at the same step, while only the writing rank
tells anyone.

An alert (``MonitorConfig.alerts``) is one record on the logger ``monitored_optim.alerts``
(:data:`LOGGER`) and, where the figures go to a tracker that can reach a person, that tracker's
call (W&B ``run.alert``, trackio ``trackio.alert``, Comet ``send_notification``, or a user sink's
``alert(title, text, level)``). A lasting event is one alert: per kind, at most one every
:data:`INTERVAL` seconds; the first is always told, a later one says how many were held back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._warnings import warn

KINDS = {
    "nonfinite": "a NaN or Inf in a layer's grad, update or weight",
    "spikes": "a layer's grad norm or update far above its recent values (health/spikes)",
    "skipped": "the guard skipped a step",
    "stalled": "the guard skipped more steps in a row than MonitorConfig.skip_budget",
    "unchanged": "a layer with a grad left unchanged for 3 logging steps",
    "no_grad": "a layer without a grad for 3 logging steps",
}
"""The event kinds ``MonitorConfig.alerts`` and ``stop_on`` take, and what each means."""

ERRORS = frozenset({"nonfinite", "stalled"})
"""The kinds told at ERROR level; the others at WARNING."""

INTERVAL = 600.0
"""Seconds between two alerts of one kind (the first is always told)."""

LOGGER = logging.getLogger("monitored_optim.alerts")
"""The logger every alert is recorded on."""

SHOWN = 5
"""Layers named in one alert."""

TITLE = 64
"""The longest title a tracker gets (W&B's limit)."""


class Voice:
    """The one voice of a run: its warnings and alerts come from the writing rank alone.

    Args:
        tells: whether this process tells (the monitor's ``Delivery.writes``); default: always.
        alerts: the event kinds told as alerts (a subset of :data:`KINDS`).
        stop_on: the event kinds after which ``should_stop`` is True.
        send: ``send(title, text, level, step)``, the trackers' alert calls (the monitor's backends), or
            None.
        clock: the time in seconds, for the rate limit (default ``time.time``).

    Attributes:
        should_stop: True from the step of the first event of a kind in ``stop_on`` (or a stop the
            guard asks for) on, on every rank.
        stop_reason: what asked to stop (``"nonfinite at step 12"``), None before.
    """

    def __init__(self, tells: Callable[[], bool] = lambda: True, alerts: frozenset[str] = frozenset(),
                 stop_on: frozenset[str] = frozenset(), send: Callable[[str, str, int, int], None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.tells, self.alerts, self.stop_on, self.send = tells, alerts, stop_on, send
        self.clock = clock or time.time
        self.should_stop = False
        self.stop_reason: str | None = None
        self._last: dict[str, float] = {}  # kind -> when its last alert was told
        self._untold: dict[str, int] = {}  # kind -> alerts held back since its last

    def warn(self, text: str, category: type[Warning] = RuntimeWarning) -> None:
        """``warnings.warn(text, category)`` in the process that tells."""
        if self.tells():
            warn(text, category)

    def event(self, kind: str, step: int, layers: Sequence[str] = (), stop: bool = False) -> None:
        """Record event ``kind`` (of :data:`KINDS`) at optimizer ``step``: ask to stop where ``stop`` or
        ``stop_on`` holds it, and tell it as an alert where ``alerts`` holds it (rate-limited).

        ``layers``: the layers it concerns, each with its figures (``"fc1.weight (grad)"``), first
        first."""
        if (stop or kind in self.stop_on) and not self.should_stop:
            self.should_stop, self.stop_reason = True, f"{kind} at step {step}"
        if kind not in self.alerts or not self.tells():
            return
        now, last = self.clock(), self._last.get(kind)
        if last is not None and now - last < INTERVAL:
            self._untold[kind] = self._untold.get(kind, 0) + 1
            return
        untold, self._last[kind], self._untold[kind] = self._untold.get(kind, 0), now, 0
        level = logging.ERROR if kind in ERRORS else logging.WARNING
        title, text = _words(kind, step, layers, untold)
        LOGGER.log(level, "%s: %s", title, text)
        if self.send is not None:
            self.send(title[:TITLE], text, level, step)

    def state_dict(self) -> dict[str, Any]:
        """The clocks of the alerts, to resume with (:meth:`load_state_dict`); a stop is not kept (a run
        resumed is a run that goes on)."""
        return {"last": dict(self._last), "untold": dict(self._untold)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`state_dict` gave."""
        self._last, self._untold = dict(state.get("last", {})), dict(state.get("untold", {}))


def _words(kind: str, step: int, layers: Sequence[str], untold: int) -> tuple[str, str]:
    """The title and text of an alert of ``kind`` at ``step`` about ``layers`` (``untold``: alerts of that
    kind held back since the last one told)."""
    title = f"monitored_optim: {kind} at step {step}"
    text = KINDS[kind]
    if layers:
        more = f" and {len(layers) - SHOWN} more" if len(layers) > SHOWN else ""
        text += ": " + ", ".join(layers[:SHOWN]) + more
    if untold:
        text += f" ({untold} more {kind} alert{'s' if untold > 1 else ''} held back since the last one)"
    return title, text

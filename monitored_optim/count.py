"""The monitor's count of optimizer steps: the x axis of every logged figure."""

from __future__ import annotations

from typing import Any

from ._warnings import Once


class StepCount:
    """Optimizer steps completed and the last one logged.

    Args:
        calls: every call of ``step()`` counts, a skipped one too (``MonitorConfig(count="calls")``).
        every: the logging cadence (``MonitorConfig.every``).

    Attributes:
        step: steps completed (int >= 0; the first ``step()`` makes it 1).
        logged: the last step logged (0 before the first).
    """

    def __init__(self, calls: bool = False, every: int = 1) -> None:
        self.calls, self.every = calls, every
        self.step = 0
        self.logged = 0
        self._told = Once()

    def set(self, value: Any) -> bool:
        """Set the count by hand; returns whether it moved below a step already logged, the first time.

        Raises:
            ValueError: ``value`` is not an integer >= 0.
        """
        back = _valid(value) < self.logged and self._told.first()
        self.step = value
        return back

    def resume_at(self, step: Any) -> None:
        """Continue from ``step``, a loaded checkpoint's count, quietly (a rollback included).

        Raises:
            ValueError: ``step`` is not an integer >= 0.
        """
        self.step = _valid(step)
        self.logged = min(self.logged, step)

    def took(self) -> int:
        """Count a step taken; returns the count."""
        self.step += 1
        return self.step

    def logged_now(self) -> None:
        """Mark the step just counted as logged."""
        self.logged = self.step

    def skipped(self) -> None:
        """Count a step skipped (by an AMP GradScaler, DeepSpeed or the guard) where every call of
        ``step()`` counts."""
        if self.calls:
            self.step += 1

    def logs_next(self) -> bool:
        """Whether the next step is a logging step (``step % every == 0`` after it)."""
        return not (self.step + 1) % self.every


def _valid(value: Any) -> int:
    """``value`` if it is an integer >= 0 (a bool is not), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"opt.monitor.step={value!r} is not valid: expected an integer >= 0")
    return value

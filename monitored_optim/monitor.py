"""The Monitor: the public ``opt.monitor``.

What users call: the step count (:attr:`Monitor.step`, :meth:`Monitor.resume_at`), the figures of the
last logging step (``latest``), the acting state (``step_was_skipped``, ``should_stop``, the guard's
and the alerts' memory for a checkpoint), the models watched, and what reads the run back
(:class:`~monitored_optim.readback.ReadBack`). Each ``step()`` runs through the monitor's internal
:class:`~monitored_optim.engine.Engine`, whose stages are :class:`~monitored_optim.flow.Flow`'s.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from . import backends, families, pieces, usage
from .alerts import Voice
from .capture import Capture, closure_is_first, closure_runs_ahead
from .config import MonitorConfig, Settings, resolve
from .count import StepCount
from .deliver import Delivery
from .engine import Engine
from .figures import Figures
from .flow import Flow
from .guard import Guard
from .health import Health
from .models import Models
from .readback import ReadBack
from .updates import view_for


class Monitor(ReadBack):
    """Counts optimizer steps and, every ``every`` steps, measures and logs each parameter's update.

    Reached as ``opt.monitor`` on a ``Monitored(...)`` optimizer; users do not build it.

    Attributes:
        step: optimizer steps completed (int; the first ``step()`` makes it 1; AMP-skipped steps
            count only with ``MonitorConfig(count="calls")``), the x axis of every figure. May be set
            (an int >= 0) to continue a checkpoint's axis; below a logged step that warns once.
        latest: ``dict[str, float]``, tag -> value of the last logging step (empty before it).
        settings: the checked :class:`~monitored_optim.config.Settings`.
        health: the :class:`~monitored_optim.health.Health` tracker (``health.skipped_steps``).

    Raises:
        ValueError, TypeError: from :func:`~monitored_optim.config.resolve` for bad configuration;
        ImportError: a requested backend's package is not installed;
        OSError: the log directory of a file backend cannot be created.
    """

    def __init__(self, config: MonitorConfig | None, optimizer_cls: type[torch.optim.Optimizer]) -> None:
        self.config = config
        self.settings: Settings = resolve(config)
        backends.check_installed(self.settings.backends)
        self._count = StepCount(self.settings.count == "calls", self.settings.every)
        chosen = families.build(self.settings.figures)
        keys = pieces.keys(chosen)  # every piece key and its reduction: the sharded table's rows
        capture = Capture(view_for(optimizer_cls), self.settings, chosen, keys.heads)
        self._delivery = Delivery(self.settings)
        self._voice = Voice(self._delivery.writes, self.settings.alerts, self.settings.stop_on, self._delivery.alert)
        families.speak(chosen, self._voice)  # warnings and events where the figures are written
        self.health = Health(self._voice)
        self._guard = Guard(self.settings.guard, self.settings.skip_budget, self._voice) \
            if self.settings.guard else None
        figures = Figures(self.settings, chosen, self.health, capture.silent)  # no cycle through self
        self._usage = usage.Usage(optimizer_cls.__name__)
        self._models = Models()  # the names of parameters after the models, and the models watched
        flow = Flow(self.settings, capture, figures, keys, self._count, self._delivery, self.health, self._guard,
                    self._models, closure_is_first(optimizer_cls), closure_runs_ahead(optimizer_cls))
        self._engine = Engine(flow, self._usage)  # what each step() runs through
        weakref.finalize(self, self._delivery.close)  # a monitor collected unclosed closes its files

    @property
    def step(self) -> int:
        """Optimizer steps completed: the x axis of every logged figure (see the class docstring)."""
        return self._count.step

    @step.setter
    def step(self, value: int) -> None:
        was, logged = self._count.step, self._count.logged
        if self._count.set(value):
            self._voice.warn(f"monitored_optim: the monitor's step moves back from {was} to {value}, below step "
                             f"{logged} that it already logged, so figures will be logged again at steps already "
                             "used; set opt.monitor.step to the step your checkpoint was saved at")

    def resume_at(self, step: int) -> None:
        """Continue the count from ``step``, a loaded checkpoint's, quietly (a rollback included: what
        was logged after ``step`` is superseded); setting :attr:`step` below a logged step warns instead.

        Raises:
            ValueError: ``step`` is not an integer >= 0.
        """
        self._count.resume_at(step)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the guard (``MonitorConfig.guard``) skipped the last ``step()`` (False without it)."""
        return self._guard is not None and self._guard.last_skipped

    @property
    def should_stop(self) -> bool:
        """Whether an event asked to stop (``MonitorConfig.stop_on``, or the guard past its
        ``skip_budget``): True on every rank from the same step on."""
        return self._voice.should_stop

    def acting_state(self) -> dict[str, Any]:
        """What the guard and the alerts keep across steps (the guard's counts and spike history, the
        alerts' clocks), for a checkpoint; empty with both off."""
        state: dict[str, Any] = {"guard": self._guard.state_dict()} if self._guard is not None else {}
        if self.settings.alerts:
            state["alerts"] = self._voice.state_dict()
        return state

    def load_acting_state(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`acting_state` gave (a part for what is off here is left aside)."""
        if self._guard is not None and isinstance(state.get("guard"), dict):
            self._guard.load_state_dict(state["guard"])
        if isinstance(state.get("alerts"), dict):
            self._voice.load_state_dict(state["alerts"])

    def _bind(self, optimizer: torch.optim.Optimizer, saved: list[list[str | None]] | None = None,
              model: torch.nn.Module | None = None, wrapper: Any = None) -> None:
        """Bind to the optimizer once it is built (:func:`monitored_optim.monitored.bind` calls it): name its
        parameters as ``saved`` (by position, from a pickle), after ``config.model`` and after ``model`` (one
        of several optimizers of a model, a DeepSpeed engine's), then attach the engine (``wrapper``: the
        DeepSpeed wrapper that steps it, where already known) and watch ``config.model``."""
        for group, own in zip(optimizer.param_groups, saved or []):
            for p, name in zip(group["params"], own):
                if name is not None:
                    self._models.name(p, name)
        watched = self.config.model if self.config is not None else None
        for m in (m for m in (watched, model) if m is not None):
            self._models.name_after(m)
        self._engine.attach(optimizer, self._models.names, wrapper)
        if watched is not None:
            self.watch(watched)

    def watch(self, model: torch.nn.Module) -> list[str]:
        """Name the optimizer's parameters after ``model``'s, and warn about those it does not hold.

        Parameters that param groups hold without names get the names the plain model inside
        ``model``'s wrappers gives them (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.`` left
        out: :func:`~monitored_optim.models.own_named_parameters`; a tied weight its first name);
        each trainable parameter of ``model`` that no param group holds is warned about once.

        Checked now and again at every logging step (param groups can be added later).

        Returns:
            The names of the trainable parameters of ``model`` missing from the optimizer now.

        Raises:
            TypeError: ``model`` is not a ``torch.nn.Module``.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch() expects a torch.nn.Module, got {type(model).__name__}")
        self._models.watch(model)
        return [] if self._engine.optimizer is None else self.health.check_watched(model, self._engine.model_params())

    def close(self) -> None:
        """Flush and close the backends, let go of the parameters held (idempotent; the backends of a monitor
        not closed are closed at exit)."""
        self._engine.flow.capture.release()
        self._delivery.close()
        usage.tell_unstepped([self._usage])

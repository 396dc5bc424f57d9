"""How a monitored optimizer's steps are run: by itself, or by an engine that steps it for it.

:class:`Engine` is the monitor's internal part that ``step()`` runs through (``Monitored.step``, the AMP
patch and DeepSpeed's wrapper call it; users do not). It hands each base step to the optimizer's
:class:`Stepper`, found once: :class:`Alone` for an optimizer that steps its own param groups, or
:class:`EngineSteps` where a DeepSpeed wrapper steps it. Both run the same stages of
:class:`~monitored_optim.flow.Flow` (begin, the parts, end), so nothing above them asks which one it has.

DeepSpeed's ZeRO wrappers call the optimizer's ``step()`` once per param group or sub-group
(:mod:`monitored_optim.distributed.deepspeed`), and the FP16 wrappers once more at build time to
create the state. Their own ``step()`` is the step a user counts: :class:`EngineSteps` makes the
monitor count one per call of it (none where it steps nothing: an fp16 overflow, a skipped step)
and, on a logging step, capture each base step's param groups into one logging step, reduced once
when the wrapper's step returns.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from . import amp, distributed, usage
from .capture import Capture, plan
from .config import Settings
from .distributed import deepspeed
from .flow import Flow, Pending
from .updates import View
from .updates.view import bind

Step = Callable[..., Any]
"""The unhooked base step, called as ``step_fn(optimizer, *args, **kwargs)``."""


class Stepper(Protocol):
    """What runs a monitored optimizer's base steps: :class:`Alone` or :class:`EngineSteps`."""

    @property
    def layout(self) -> deepspeed.Layout | None:
        """DeepSpeed's layout, where its wrapper steps the optimizer (None: the optimizer steps itself)."""

    def call(self, optimizer: torch.optim.Optimizer, step_fn: Step, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """Run one base step (its capture on a logging step); returns what it returns."""

    def model_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The model's parameters that ``optimizer`` steps."""


class Engine:
    """A monitor's binding to its optimizer and the run of each ``step()``: the engine protocol.

    Args:
        flow: the stages of a step (its capture holds the update view of the optimizer's class, bound to
            the optimizer by :meth:`attach`).
        used: the monitor's record of being built and stepped (for the notice at exit).

    Attributes:
        base_calls: base steps called so far (the AMP patch compares it around a GradScaler's step).
    """

    def __init__(self, flow: Flow, used: usage.Usage) -> None:
        self.flow, self._usage = flow, used
        self.base_calls = 0
        self._optimizer: Callable[[], torch.optim.Optimizer | None] = lambda: None
        self._born: dict[int, str] = {}  # id -> name of the parameters the optimizer was built with
        self._stepper: Stepper = Alone(flow)
        self._looked: set[int] | None = None  # ids of tensors that led a param group when none was found
        self._searching = True  # until a DeepSpeed wrapper is found stepping the optimizer

    def attach(self, optimizer: torch.optim.Optimizer, names: dict[int, str], wrapper: Any = None) -> None:
        """Bind to the optimizer once it is built: bind the view to it, warn about unnamed parameters, find
        matrices the snapshot rule takes from the first logging step. ``names``: id -> name after the
        models; ``wrapper``: the DeepSpeed wrapper that steps it, where already known, which then counts
        its steps."""
        self._optimizer = weakref.ref(optimizer)
        self._usage.built = True
        self.flow.capture.use(bind(self.view, optimizer))
        told = self.flow.told if wrapper is None else None  # DeepSpeed's flat buffers are named by its layout
        every, chosen = plan.born(optimizer, names, self.flow.settings.select, told)
        self._born = {id(p): n for n, p in every}
        self.flow.capture.risk.mark_when_built(chosen)
        if wrapper is not None:
            self._stepper = EngineSteps(self.flow, self._optimizer, wrapper, False, self._born, names)
            self._searching = False

    def run(self, optimizer: torch.optim.Optimizer, step_fn: Step, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        """Call ``step_fn(optimizer, *args, **kwargs)`` (the unhooked base step) once and monitor it.

        Under ``torch.compile(opt.step)`` a non-logging step traces to the plain optimizer's graph;
        a logging step runs the capture before and after the base step outside the compiled graphs
        (``torch.compiler.disable``), while the base step itself stays compiled, so the trajectory
        is the plain compiled optimizer's.

        Returns what the base step returns (the closure's loss, if any).
        """
        if not self._usage.stepped:
            self._usage.stepped = usage.ANY.stepped = True
        stepper = self._stepper_of(optimizer)
        self.base_calls += 1
        return stepper.call(optimizer, step_fn, args, kwargs)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer bound (None before :meth:`attach`, or once it is gone)."""
        return self._optimizer()

    @property
    def view(self) -> View:
        """The update view the capture uses (bound to the optimizer once attached)."""
        return self.flow.capture.view

    @property
    def capture(self) -> Capture:
        """The flow's capture (its plan, spent record and rules' memories)."""
        return self.flow.capture

    @property
    def settings(self) -> Settings:
        """The monitor's checked settings."""
        return self.flow.settings

    @property
    def layout(self) -> deepspeed.Layout | None:
        """DeepSpeed's layout once its wrapper is found stepping the optimizer (None: it steps itself)."""
        return self._stepper.layout

    def skipped(self) -> None:
        """Count a step that an AMP GradScaler skipped (``health/skipped_steps``, and the step itself
        when ``count="calls"``)."""
        self.flow.skipped()

    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters the optimizer steps (none once it is gone)."""
        optimizer = self._optimizer()
        return [] if optimizer is None else self._stepper.model_params(optimizer)

    def _stepper_of(self, optimizer: torch.optim.Optimizer) -> Stepper:
        """The stepper of ``optimizer`` now: under ``torch.distributed``, a DeepSpeed wrapper is looked for at
        the first step, and again when a param group leads with a tensor the optimizer was not built with
        and not yet looked into (DeepSpeed puts its flat buffers there after a first step taken without
        it); never again once found."""
        if self._searching and distributed.initialized() and self._due(optimizer):
            found = deepspeed.find(optimizer)
            if found is None:
                leads = (id(group["params"][0]) for group in optimizer.param_groups if group["params"])
                self._looked = (self._looked or set()) | set(leads)
            else:
                self._stepper = EngineSteps(self.flow, self._optimizer, *found, self._born,
                                            self.flow.models.names)
                self._searching = False
        return self._stepper

    def _due(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether to look (again): the first step, or a param group leads with a tensor neither born
        nor looked into."""
        looked = self._looked
        return looked is None or any(group["params"] and id(group["params"][0]) not in self._born
                                     and id(group["params"][0]) not in looked for group in optimizer.param_groups)


class Alone:
    """The stepper of an optimizer that steps its param groups itself, each tensor a parameter: its
    step is one base step, skipped where a GradScaler or the guard skips it."""

    layout: None = None

    def __init__(self, flow: Flow) -> None:
        self._flow = flow

    def call(self, optimizer: torch.optim.Optimizer, step_fn: Step, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        flow = self._flow
        if flow.guard is not None:
            flow.guard.last_skipped = False  # until it judges this step (a GradScaler may skip it first)
        if amp.skips(optimizer):  # a fused optimizer under GradScaler
            flow.skipped()
            return step_fn(optimizer, *args, **kwargs)
        if flow.guard is not None:
            skips, args, kwargs, loss = flow.guard_skips(optimizer, args, kwargs)
            if skips:
                return loss
        pending = flow.begin(optimizer)
        out, _ = flow.part(optimizer, pending, step_fn, args, kwargs)
        flow.end(pending, params=lambda: self.model_params(optimizer))
        return out

    @staticmethod
    def model_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]


class EngineSteps:
    """The stepper of a DeepSpeed wrapper: its count and capture of the wrapper's steps, and its layout.

    Args:
        flow: the stages of a step.
        optimizer: the monitored optimizer, held weakly (the wrapper holds it, and it the monitor).
        wrapper: the DeepSpeed wrapper whose ``step`` is made the one the monitor counts.
        inside: the wrapper was found inside its own ``step()``: that step is counted as well, and
            ends with the base step of the wrapper's last flat buffer.
        born: id -> name of the parameters the optimizer was built with.
        names: id -> name of the parameters after the models.
    """

    def __init__(self, flow: Flow, optimizer: Callable[[], torch.optim.Optimizer | None], wrapper: Any,
                 inside: bool, born: dict[int, str], names: dict[int, str]) -> None:
        if flow.guard is not None:
            raise ValueError(NO_GUARD_UNDER_DEEPSPEED)
        self._flow, self._optimizer = flow, optimizer
        self.layout = deepspeed.Layout(wrapper, born, names)
        self._pending: Pending | None = None  # a logging step in progress
        self._calls = 0  # base steps called during the wrapper's step
        self._last: int | None = None  # id of the flat buffer that ends the step found inside
        self._inside = inside  # the step found inside begins at the base step that found it
        deepspeed.engine_step(wrapper, self.step)

    def step(self, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The wrapper's ``step()``: one optimizer step of the engine, measured every ``every`` steps."""
        if self._optimizer() is None:
            return step(*args, **kwargs)
        self._begin()
        try:
            out = step(*args, **kwargs)
        except BaseException:
            self._pending = None
            raise
        self._end()
        return out

    def call(self, optimizer: torch.optim.Optimizer, step_fn: Step, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """A base step that the wrapper calls, inside its step or not (the one it takes at build time
        is not counted); on a logging step, the capture of the param groups it steps."""
        if self._inside:
            self._inside = False
            self._last = self.layout.last()
            self._begin()
        self._calls += 1
        pending = self._pending
        if pending is None and self._last is None:
            return step_fn(optimizer, *args, **kwargs)
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        groups = None
        if pending is not None:
            pending.sharding.regrad(stepped)  # the wrapper sets the flat grads just before it steps
            groups = pending.sharding.groups_of(stepped)
        out, made = self._flow.part(optimizer, pending, step_fn, args, kwargs, groups)
        if pending is not None and made is not None:
            pending.sharding.release(made.all)  # no grad of the wrapper's is held past its base step
        if self._last in stepped:  # the step found inside ends here
            self._last = None
            self._end()
        return out

    def model_params(self, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
        """The model's parameters in the wrapper's flat buffers (``optimizer``: unused, as it steps them)."""
        params: list[torch.Tensor] = []
        for _, fragments in self.layout.groups():
            for h in fragments:
                assert h.source is not None  # a fragment of a DeepSpeed layout names its parameter
                params.append(h.source)
        return params

    def _begin(self) -> None:
        optimizer = self._optimizer()
        assert optimizer is not None  # called by call() or step(), with the optimizer alive
        self._calls = 0
        self._pending = self._flow.begin(optimizer, self.layout)

    def _end(self) -> None:
        pending, self._pending = self._pending, None
        source = self.layout.optimizer() if pending is not None else None  # all of DeepSpeed's groups
        self._flow.end(pending, stepped=self._calls > 0, source=source, local_groups=True, params=self.model_params)


NO_GUARD_UNDER_DEEPSPEED = (
    "MonitorConfig.guard cannot skip a DeepSpeed engine's steps: DeepSpeed steps its flat buffers itself, "
    "one param group after another, and no base step may be left out of one of them; use DeepSpeed's own "
    "means (fp16 dynamic loss scaling skips a step whose grads overflow), and keep MonitorConfig(alerts=..., "
    "stop_on=...) to hear of a NaN and stop")
"""Why the guard refuses a DeepSpeed engine."""

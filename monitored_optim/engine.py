"""The steps of an engine that calls the optimizer's ``step()`` several times per step of its own.

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
from typing import Any

import torch

from . import distributed
from ._warnings import Once
from .capture import plan
from .distributed import deepspeed
from .figures import group_lrs


def find(monitor: Any, optimizer: torch.optim.Optimizer) -> EngineSteps | None:
    """The :class:`EngineSteps` of the DeepSpeed wrapper now calling ``optimizer.step()``, or None."""
    found = deepspeed.find(optimizer) if distributed.initialized() else None
    return None if found is None else EngineSteps(monitor, optimizer, *found)


class Search:
    """A monitor's layout: :data:`ALONE` until a DeepSpeed wrapper is found stepping the optimizer.

    It is looked for at the first step, and again when a param group leads with a tensor the optimizer
    was not built with and not yet looked into (DeepSpeed puts its flat buffers there after a first step
    taken without it); never again once found.

    Attributes:
        born: id -> name of the parameters the optimizer was built with.
        layout: the layout found (:class:`EngineSteps`), or :data:`ALONE`.
    """

    def __init__(self) -> None:
        self.born: dict[int, str] = {}
        self.layout: EngineSteps | Alone = ALONE
        self._looked: set[int] | None = None  # ids of tensors that led a param group when none was found

    def layout_of(self, monitor: Any, optimizer: torch.optim.Optimizer) -> EngineSteps | Alone:
        """The layout that steps ``optimizer`` now, looked for where due."""
        if self.layout is ALONE and self._due(optimizer):
            found = find(monitor, optimizer)
            if found is None:
                leads = (id(group["params"][0]) for group in optimizer.param_groups if group["params"])
                self._looked = (self._looked or set()) | set(leads)
            self.layout = found or ALONE
        return self.layout

    def _due(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether to look (again): the first step, or a param group leads with a tensor neither born
        nor looked into."""
        looked = self._looked
        return looked is None or any(group["params"] and id(group["params"][0]) not in self.born
                                     and id(group["params"][0]) not in looked for group in optimizer.param_groups)


class Alone:
    """The layout of an optimizer that steps its param groups itself, each tensor a parameter: the
    trivial one, beside :class:`EngineSteps` (whose methods of the same names answer for DeepSpeed)."""

    @staticmethod
    def source(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose param groups carry the learning rates of every parameter."""
        return optimizer

    @staticmethod
    def local_lrs(groups: list[dict[str, Any]]) -> list[float | None] | None:
        """The learning rates of the param groups the capture reads, where they differ from the
        source's groups (None: they are the source's)."""
        return None

    @staticmethod
    def model_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The model's parameters that ``optimizer`` steps."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    @staticmethod
    def tell_unmapped(optimizer: torch.optim.Optimizer, told: Once) -> None:
        """Warn once about a param group whose names and tensors differ in number
        (:func:`~monitored_optim.capture.plan.tell_unmapped`)."""
        plan.tell_unmapped(optimizer, told)


ALONE = Alone()
"""The layout of every optimizer that steps its own param groups."""


class EngineSteps:
    """A monitor's count and capture of a DeepSpeed wrapper's steps, and its layout.

    Args:
        monitor: the :class:`~monitored_optim.monitor.Monitor` (held weakly; its ``begin``, ``part``
            and ``end`` run the step).
        optimizer: the monitored optimizer.
        wrapper: the DeepSpeed wrapper whose ``step`` is made the one the monitor counts.
        inside: the wrapper was found inside its own ``step()``: that step is counted as well, and
            ends with the base step of the wrapper's last flat buffer.
    """

    def __init__(self, monitor: Any, optimizer: torch.optim.Optimizer, wrapper: Any, inside: bool) -> None:
        self._monitor = weakref.ref(monitor)
        self.layout = deepspeed.Layout(wrapper, monitor._search.born, monitor._models.names)
        self._pending: Any = None  # a logging step in progress
        self._calls = 0  # base steps called during the wrapper's step
        self._last: int | None = None  # id of the flat buffer that ends the step found inside
        deepspeed.engine_step(wrapper, self.step)
        if inside:
            self._last = self.layout.last()
            self._begin(optimizer)

    def step(self, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The wrapper's ``step()``: one optimizer step of the engine, measured every ``every`` steps."""
        monitor = self._monitor()
        optimizer = monitor._optimizer() if monitor is not None else None
        if optimizer is None:
            return step(*args, **kwargs)
        self._begin(optimizer)
        try:
            out = step(*args, **kwargs)
        except BaseException:
            self._pending = None
            raise
        self._end(optimizer)
        return out

    def call(self, optimizer: torch.optim.Optimizer, step_fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """A base step that the wrapper calls, inside its step or not (the one it takes at build time
        is not counted); on a logging step, the capture of the param groups it steps."""
        monitor = self._monitor()
        assert monitor is not None  # the monitor calls it
        monitor.base_calls += 1
        self._calls += 1
        pending = self._pending
        if pending is None and self._last is None:
            return step_fn(optimizer, *args, **kwargs)
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        groups = None
        if pending is not None:
            pending.sharding.regrad(stepped)  # the wrapper sets the flat grads just before it steps
            groups = pending.sharding.groups_of(stepped)
        out, made = monitor.part(optimizer, pending, step_fn, args, kwargs, groups)
        if pending is not None and made is not None:
            pending.sharding.release(made.all)  # no grad of the wrapper's is held past its base step
        if self._last in stepped:  # the step found inside ends here
            self._last = None
            self._end(optimizer)
        return out

    def source(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose param groups carry the learning rates: all of DeepSpeed's groups."""
        return self.layout.optimizer()

    @staticmethod
    def local_lrs(groups: list[dict[str, Any]]) -> list[float | None] | None:
        """The learning rates of the param groups the capture reads: DeepSpeed's flat buffers (its
        sub-groups at stage 3)."""
        return group_lrs(groups)

    @staticmethod
    def tell_unmapped(optimizer: torch.optim.Optimizer, told: Once) -> None:
        """Nothing: DeepSpeed's flat buffers are mapped to the named parameters by ``layout``."""

    def model_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The model's parameters in the wrapper's flat buffers (``optimizer``: unused, as it steps them)."""
        params: list[torch.Tensor] = []
        for _, fragments in self.layout.groups():
            for h in fragments:
                assert h.source is not None  # a fragment of a DeepSpeed layout names its parameter
                params.append(h.source)
        return params

    def _begin(self, optimizer: torch.optim.Optimizer) -> None:
        monitor = self._monitor()
        assert monitor is not None  # called by __init__, step() or call(), with the monitor alive
        self._calls = 0
        self._pending = monitor.begin(optimizer, self.layout)

    def _end(self, optimizer: torch.optim.Optimizer) -> None:
        monitor = self._monitor()
        assert monitor is not None  # called by step() or call(), with the monitor alive
        pending, self._pending = self._pending, None
        monitor.end(optimizer, pending, stepped=self._calls > 0)

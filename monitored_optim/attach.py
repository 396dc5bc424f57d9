"""``attach(obj)``: monitor an optimizer that already exists, in place.

Most optimizers are built by a framework (the HF Trainer, Lightning, DeepSpeed, timm's factory),
often wrapped before the user sees them (accelerate's ``AcceleratedOptimizer``, Lightning's
``LightningOptimizer``, DeepSpeed's ZeRO wrappers) and with their ``step`` already wrapped by an
LR scheduler. :func:`attach` finds the torch optimizer inside, turns its class into
``Monitored(cls)`` and gives it a monitor, so that it is the optimizer ``Monitored(cls)`` would
have built; the step wrappers made before point at the monitored step (:func:`reroute`).
"""

from __future__ import annotations

import types
from typing import Any, TypeVar

import torch

from ._warnings import warn
from .config import MonitorConfig
from .distributed.deepspeed import is_wrapper
from .engine import NO_GUARD_UNDER_DEEPSPEED
from .monitor import Monitor
from .monitored import Monitored, bind, bound, steps_kept

T = TypeVar("T")

_WRAPPER_PACKAGES = ("accelerate.", "lightning.", "pytorch_lightning.", "deepspeed.runtime.")
"""Packages with optimizer classes that wrap another optimizer (held as ``optimizer`` or ``_optimizer``)."""


def attach(obj: T, config: MonitorConfig | None = None) -> T:
    """Monitor the optimizer ``obj`` is or holds, in place, and return ``obj``.

    Afterwards the torch optimizer is an instance of ``Monitored(type(optimizer))`` and its monitor
    is its ``.monitor``: the same object, param groups, state and trajectory bit for bit; its
    ``state_dict()`` loads into the plain class. What wrapped or hooked its step before (an LR
    scheduler, step hooks, accelerate's or a trainer's wrapper) still runs once per step. The step
    axis continues from the steps the optimizer has taken (its state's count). Attaching an
    optimizer that is already monitored changes nothing (the monitor keeps its configuration).

    Example::

        trainer = SomeTrainer(model)            # builds and wraps its own optimizer
        attach(trainer.optimizer)               # or attach(deepspeed_engine)
        monitor_of(trainer.optimizer).latest

    Args:
        obj: a ``torch.optim.Optimizer``, or a wrapper holding one: accelerate's
            ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, a DeepSpeed engine or its
            optimizer wrappers (the torch optimizer found through ``optimizer``/``_optimizer``).
        config: as for ``Monitored(cls)(..., monitor=config)``; ``None`` reads the environment.

    Returns:
        ``obj`` itself.

    Raises:
        TypeError: ``obj`` holds no torch optimizer.
        ValueError, ImportError, OSError: bad configuration, as ``Monitored(cls)`` raises them.

    Warns:
        RuntimeWarning: the optimizer has state but keeps no step count (SGD): the axis starts at
        step 1; set ``opt.monitor.step`` to the steps taken to continue it. Also where a wrapper of
        its step cannot be followed, and where it is already monitored with another ``config``.
    """
    return attach_at(obj, config, None)


def attach_at(obj: T, config: MonitorConfig | None, steps: int | None, names: torch.nn.Module | None = None) -> T:
    """:func:`attach`, with the step axis continued from ``steps`` where the caller knows the steps
    taken (a trainer's global step), else from the optimizer's own count, and parameters named
    after ``names`` (a model that several optimizers share) too."""
    optimizer, wrapper, model = _inside(obj)
    base = type(optimizer)
    already = bound(optimizer)
    if already is not None:  # already monitored: one monitor
        current = already.config
        if config is not None and config != current:
            warn(f"monitored_optim: this {base.__name__} is already monitored, with {current!r}; the configuration "
                 "given now is not used (a monitor's configuration is fixed when it is made)", RuntimeWarning)
        return obj
    monitor = Monitor(config, base)  # bad configuration fails before the optimizer changes
    if wrapper is not None and monitor.settings.guard:  # as would the engine's stepper, once bound
        raise ValueError(NO_GUARD_UNDER_DEEPSPEED)
    hooked = base.step
    optimizer.__class__ = Monitored(base)
    optimizer._patch_step_function()  # torch's hook wrapper on the monitored step, as __init__ does
    if "step" in vars(optimizer) and not reroute(optimizer, hooked, type(optimizer).step):
        warn(f"monitored_optim: the {base.__name__}'s step was wrapped before attach() in a way it cannot follow "
             "(a functools.partial's arguments, an object holding the bound method), so the steps taken through "
             "that wrapper are not monitored; attach() before wrapping opt.step", RuntimeWarning)
    count = steps if steps is not None else steps_kept(
        optimizer, 0, f"the {base.__name__} attached has taken steps but keeps no step count, so the monitor's x axis "
        "starts at step 1; set opt.monitor.step to the steps taken to continue it", monitor._voice)
    bind(optimizer, monitor, count, model=model if model is not None else names, wrapper=wrapper)
    return obj


def monitor_of(obj: Any) -> Monitor:
    """The monitor of the optimizer ``obj`` is or holds (through the wrappers :func:`attach` knows).

    Example: ``monitor_of(trainer.optimizer).latest``, under accelerate's wrapper, DeepSpeed's or
    Lightning's alike.

    Raises:
        TypeError: ``obj`` holds no torch optimizer.
        ValueError: the optimizer it holds is not monitored.
    """
    optimizer = _inside(obj)[0]
    monitor = bound(optimizer)
    if monitor is None:
        raise ValueError(f"the {type(optimizer).__name__} in {type(obj).__name__} is not monitored: "
                         "monitored_optim.attach() it, or build it from Monitored(cls)")
    return monitor


def _inside(obj: Any) -> tuple[torch.optim.Optimizer, Any, torch.nn.Module | None]:
    """The torch optimizer in ``obj``, the DeepSpeed wrapper that steps it (or None), and the model
    of a DeepSpeed engine met on the way (or None)."""
    seen, wrapper, model, inner = [], None, None, obj
    while inner is not None and not _is_optimizer(inner):
        if id(inner) in seen:
            break
        seen.append(id(inner))
        if is_wrapper(inner):
            wrapper = inner
        if model is None and isinstance(inner, torch.nn.Module) and isinstance(module := getattr(inner, "module", None),
                                                                               torch.nn.Module):
            model = module  # a DeepSpeed engine (its .module is the model)
        inner = _inner(inner)
    if inner is None or not _is_optimizer(inner):
        raise TypeError(f"attach() expects a torch.optim.Optimizer or a wrapper holding one (accelerate's, "
                        f"Lightning's, a DeepSpeed engine); found none in {type(obj).__name__}")
    return inner, wrapper, model


def _inner(obj: Any) -> Any:
    """The optimizer ``obj`` holds as ``_optimizer`` or ``optimizer``, or None."""
    return getattr(obj, "_optimizer", None) or getattr(obj, "optimizer", None)


def _is_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is a torch optimizer that does the arithmetic itself, not a framework's wrapper
    of one (an optimizer of accelerate, Lightning or DeepSpeed's runtime that holds another)."""
    return isinstance(obj, torch.optim.Optimizer) and not (
        type(obj).__module__.startswith(_WRAPPER_PACKAGES) and _inner(obj) is not None)


def reroute(optimizer: torch.optim.Optimizer, old: Any, new: Any) -> int:
    """Point the step wrappers on ``optimizer`` (an instance's ``step`` attribute) that call ``old``,
    the class's step function, at ``new``; returns how many references were changed.

    An LR scheduler keeps the class's function in its wrapper's closure; accelerate keeps the
    bound method. Both are followed through wrappers of wrappers (closures, bound methods of
    ``optimizer``, the function of a ``functools.partial``); a partial's arguments and other
    objects' attributes are not.
    """
    start = vars(optimizer).get("step")
    return 0 if start is None else _reroute(start, old, new, optimizer, set())


def _reroute(fn: Any, old: Any, new: Any, optimizer: Any, seen: set[int]) -> int:
    if id(fn) in seen:
        return 0
    seen.add(id(fn))
    if isinstance(fn, types.MethodType):
        return _reroute(fn.__func__, old, new, optimizer, seen) if fn.__self__ is optimizer else 0
    if hasattr(fn, "func") and hasattr(fn, "keywords"):  # functools.partial
        return _reroute(fn.func, old, new, optimizer, seen)
    changed = 0
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if value is old:
            cell.cell_contents = new
            changed += 1
        elif isinstance(value, types.MethodType) and value.__func__ is old and value.__self__ is optimizer:
            cell.cell_contents = types.MethodType(new, optimizer)
            changed += 1
        elif callable(value) and not isinstance(value, type):
            changed += _reroute(value, old, new, optimizer, seen)
    return changed


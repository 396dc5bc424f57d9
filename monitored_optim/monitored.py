"""``Monitored(cls)``: a cached, drop-in subclass of any optimizer class whose ``step`` is monitored."""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import inspect
import math
import threading
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from . import amp
from ._warnings import warn
from .alerts import Voice
from .config import MonitorConfig
from .engine import Engine
from .monitor import Monitor
from .updates import raw_step

O = TypeVar("O", bound=type)

_CACHE: dict[type, type] = {}
_METACLASSES: dict[type, type] = {}
_LOCK = threading.Lock()


def Monitored(optimizer_cls: O) -> O:
    """Return the monitored subclass of ``optimizer_cls``, built once and cached.

    The subclass takes exactly the arguments of ``optimizer_cls`` plus a keyword-only
    ``monitor: MonitorConfig | None`` (``None``: configure from ``MONITORED_OPTIM_*`` variables), and
    behaves bit for bit like the base class: same parameters, state and ``state_dict()`` after every
    step, step hooks fired once per step, LR schedulers and closures as usual. Every
    ``MonitorConfig.every``-th step it measures each parameter's update u = p_after - p_before
    (from the optimizer's state where a view exists, else from a clone taken on that step only)
    and logs the figures listed in the README through ``opt.monitor``.

    Example::

        AdamW = Monitored(torch.optim.AdamW)        # Monitored(torch.optim.AdamW) is AdamW
        opt = AdamW(model.named_parameters(), lr=1e-3)
        isinstance(opt, torch.optim.AdamW)          # True

    Args:
        optimizer_cls: a subclass of ``torch.optim.Optimizer`` (built-in or third-party), or a
            ``functools.partial`` of one (timm's ``bind_defaults``). Passing an already monitored
            class returns it unchanged.

    Returns:
        The subclass (named ``Monitored<Name>``); the same object for the same ``optimizer_cls``.
        For a partial, the same partial of the monitored class.

    Raises:
        TypeError: ``optimizer_cls`` is not a class derived from ``torch.optim.Optimizer``, or its
            constructor already takes a ``monitor`` argument.
    """
    if isinstance(optimizer_cls, functools.partial):
        return functools.partial(Monitored(optimizer_cls.func), *optimizer_cls.args,
                                 **optimizer_cls.keywords)
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError("Monitored() expects an optimizer class, a subclass of torch.optim.Optimizer "
                        f"such as torch.optim.AdamW (the class, not an instance); got {optimizer_cls!r}")
    if any("_monitored_base" in vars(c) for c in optimizer_cls.__mro__):
        return optimizer_cls  # already monitored (or a user subclass of a monitored class)
    if "monitor" in _parameters(optimizer_cls.__init__):
        raise TypeError(f"Monitored() cannot wrap {optimizer_cls.__name__}: its constructor already takes a "
                        "'monitor' argument, the keyword Monitored() adds")
    with _LOCK:
        if optimizer_cls not in _CACHE:
            _CACHE[optimizer_cls] = _build(optimizer_cls)
        return _CACHE[optimizer_cls]  # type: ignore[return-value]


def _build(base: type[torch.optim.Optimizer]) -> type:
    def __init__(self, *args: Any, monitor: MonitorConfig | None = None, **kwargs: Any) -> None:
        built = Monitor(monitor, base)  # bad configuration fails before any optimizer work
        base.__init__(self, *args, **kwargs)
        bind(self, built)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self._monitor._engine.run(self, raw_step(base), args, kwargs)

    def _get_monitor(self) -> Monitor:
        """The :class:`~monitored_optim.monitor.Monitor` of this optimizer (step count, latest figures)."""
        return self._monitor

    def _set_monitor(self, value: Any) -> None:
        raise AttributeError(f"{base.__name__} sets its own 'monitor' attribute, which Monitored() needs for "
                             "opt.monitor; rename that attribute in the optimizer class to monitor it")

    monitor = property(_get_monitor, _set_monitor, doc=_get_monitor.__doc__)

    __getstate__, __setstate__ = _pickling(base)
    state_dict, load_state_dict = _state_dicts(base)
    __init__.__signature__ = _with_monitor_kwarg(base.__init__)  # type: ignore[attr-defined]
    __init__.__doc__ = base.__init__.__doc__
    step.__signature__ = _signature(raw_step(base))  # type: ignore[attr-defined]
    step.__doc__ = raw_step(base).__doc__
    state_dict.__signature__ = _signature(base.state_dict)
    load_state_dict.__signature__ = _signature(base.load_state_dict)
    state_dict.__doc__ = (f"{base.__name__}.state_dict() plus ``'monitor': {{'step': N}}``, the monitor's step "
                          f"count, with the guard's and the alerts' memory where they are on (ignored by the plain "
                          f"class's load_state_dict).")
    load_state_dict.__doc__ = (f"Load a state dict of this class or of the plain {base.__name__}.\n\n"
                               f"Takes the arguments {base.__name__}.load_state_dict takes. The monitor's step count "
                               "continues from the saved one; in a plain state dict, from the count the optimizer "
                               "keeps (``state[p]['step']``, ``param_groups[i]['step']`` or ``['k']``, or those of an "
                               "optimizer it wraps). Optimizer state with no count warns and starts at step 1.")
    name = f"Monitored{base.__name__}"
    namespace = {
        "__init__": __init__, "step": step, "monitor": monitor,
        "state_dict": state_dict, "load_state_dict": load_state_dict,
        "__getstate__": __getstate__, "__setstate__": __setstate__,
        "_monitored_base": base, "__module__": __name__, "__qualname__": name,
        "__doc__": f"{base.__name__} whose step() is monitored (see monitored_optim.Monitored).\n\n"
                   f"{base.__doc__ or ''}",
    }
    return _metaclass(type(base))(name, (base,), namespace)


def _pickling(base: type[torch.optim.Optimizer]) -> tuple[Any, Any]:
    """``__getstate__`` and ``__setstate__`` of ``Monitored(base)``: the monitor's configuration, step
    count and a watched model's names travel with the optimizer (the model itself does not)."""
    def __getstate__(self) -> dict[str, Any]:
        state = base.__getstate__(self)
        config = self.monitor.config
        state["_monitor_config"] = dataclasses.replace(config, model=None) if config is not None else None
        state["_monitor_step"] = self.monitor.step
        state["_monitor_acting"] = self.monitor.acting_state()
        known = self.monitor._models.names  # a watched model's names, by position (the model is not saved)
        state["_monitor_names"] = [[known.get(id(p)) for p in group["params"]] for group in self.param_groups]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickling passes what __getstate__ saved; torch's load_state_dict also calls
        # __setstate__ (with state and param_groups only), which must keep the running monitor.
        saved = "_monitor_config" in state
        config, count = state.pop("_monitor_config", None), state.pop("_monitor_step", 0)
        names, acting = state.pop("_monitor_names", []), state.pop("_monitor_acting", {})
        base.__setstate__(self, state)
        if saved:
            monitor = _rebuilt_monitor(config, base)
            monitor.load_acting_state(acting)
            bind(self, monitor, count, names)

    return __getstate__, __setstate__


def _state_dicts(base: type[torch.optim.Optimizer]) -> tuple[Any, Any]:
    """``state_dict`` and ``load_state_dict`` of ``Monitored(base)``: the step count saved beside the
    plain state, and continued from a loaded one."""
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        sd = base.state_dict(self, *args, **kwargs)
        monitor = bound(self)  # None while a base __init__ calls state_dict()
        if monitor is not None:
            sd["monitor"] = {"step": monitor.step, **monitor.acting_state()}
        return sd

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        args, kwargs, saved = _without_monitor_entry(base.load_state_dict, self, args, kwargs)
        names = [g.get("param_names") for g in self.param_groups]
        base.load_state_dict(self, *args, **kwargs)
        if len(names) == len(self.param_groups):
            # torch keeps a group's param_names when the loaded group has none; an override of
            # load_state_dict (bitsandbytes') replaces the groups and drops them: keep them likewise
            for group, kept in zip(self.param_groups, names):
                if kept is not None and "param_names" not in group and len(kept) == len(group["params"]):
                    group["param_names"] = kept
        monitor = bound(self)
        if monitor is not None and saved:  # the count this class saved: a rollback to it is deliberate, no warning
            monitor.resume_at(int(saved["step"]))
            monitor.load_acting_state(saved)
        elif monitor is not None:
            monitor.step = steps_kept(self, monitor.step, "the loaded state dict has optimizer state but no step "
                                      f"count (a plain {base.__name__} checkpoint keeps none), so the monitor's x axis "
                                      "starts again at step 1; set opt.monitor.step to the step the checkpoint was "
                                      "saved at to continue it", monitor._voice)

    return state_dict, load_state_dict


def bind(optimizer: torch.optim.Optimizer, monitor: Monitor, count: int = 0,
         saved: list[list[str | None]] | None = None, model: torch.nn.Module | None = None,
         wrapper: Any = None) -> None:
    """The one way a monitor is bound to its optimizer, built, unpickled or attached: made its ``opt.monitor``,
    its count continued from ``count``, its parameters named (``saved``: by position, from a pickle; after
    ``model`` too), and its engine attached (``wrapper``: the DeepSpeed wrapper that steps it, where known)."""
    vars(optimizer)["_monitor"] = monitor
    monitor.resume_at(count)
    monitor._bind(optimizer, saved, model, wrapper)
    amp.install(_engine_of)


def bound(optimizer: object) -> Monitor | None:
    """The monitor bound to ``optimizer``, or None: the one place that asks whether it is monitored."""
    monitor = getattr(optimizer, "__dict__", {}).get("_monitor")
    return monitor if isinstance(monitor, Monitor) else None


def _engine_of(optimizer: torch.optim.Optimizer) -> Engine | None:
    """The engine that counts ``optimizer``'s base steps, None where it is not monitored."""
    monitor = bound(optimizer)
    return None if monitor is None else monitor._engine


def steps_kept(optimizer: torch.optim.Optimizer, default: int, unknown: str, voice: Voice) -> int:
    """The steps ``optimizer`` has taken by the count it keeps (its state's, its groups'), else ``default``;
    where it keeps none, ``default`` is 0 and the optimizer has state, ``voice`` warns ``unknown`` (why the
    x axis starts at step 1)."""
    count = _step_count_kept(optimizer)
    if count is None and default == 0 and any(optimizer.state.values()):
        voice.warn(f"monitored_optim: {unknown}")
    return default if count is None else count


def _metaclass(meta: type) -> type:
    """A subclass of the base's metaclass whose classes pickle as ``Monitored(base)``.

    pickle stores a class as ``module.qualname``; a generated class has no such address, so
    ``copyreg`` reduces it to the call that rebuilds it, and the cache returns the same object.
    """
    if meta not in _METACLASSES:
        sub = type(f"Monitored{meta.__name__}", (meta,), {"__module__": __name__, "__repr__": _class_repr})
        copyreg.pickle(sub, _reduce_class)
        _METACLASSES[meta] = sub
    return _METACLASSES[meta]


def _class_repr(cls: type) -> str:
    """``<class 'monitored_optim.monitored.MonitoredAdamW' of bitsandbytes.optim.adamw.AdamW>``: the
    base's address stays in ``str(cls)``, which some trainers test (the HF Trainer's
    ``"bitsandbytes" in str(optimizer_cls)`` for its 8-bit embedding override)."""
    base = vars(cls).get("_monitored_base")
    own = f"<class '{cls.__module__}.{cls.__qualname__}'"
    return own + (f" of {base.__module__}.{base.__qualname__}>" if base is not None else ">")


def _reduce_class(cls: type) -> tuple[Any, tuple[type]]:
    return Monitored, (vars(cls)["_monitored_base"],)


def _rebuilt_monitor(config: MonitorConfig | None, base: type) -> Monitor:
    """The monitor of an unpickled optimizer, or one that logs nothing if its configuration fails here.

    A configuration that no longer resolves (a bad environment variable, a log directory that cannot
    be created) warns rather than making the checkpoint unloadable."""
    try:
        return Monitor(config, base)
    except (ValueError, OSError, ImportError) as err:
        warn(f"monitored_optim: the saved monitor configuration does not work here ({err}); "
             "this optimizer logs nothing until you load it with a working configuration", RuntimeWarning)
        return Monitor(MonitorConfig(backend="none", every=(config.every if config else None) or 1), base)


def _step_count_kept(optimizer: torch.optim.Optimizer) -> int | None:
    """The number of steps ``optimizer`` has taken, by the count it keeps (None: it keeps none).

    The first of these that holds a count gives the largest of its counts: ``state[p]["step"]``
    (torch's Adam and most others), ``param_groups[i]["step"]`` (pytorch-optimizer, timm),
    ``param_groups[i]["k"]`` (schedulefree: the steps taken); then the same in each optimizer that
    ``optimizer`` wraps (an attribute that is an optimizer, as pytorch-optimizer's
    ``Lookahead.optimizer``). A count is an int, a float or a one-element tensor.
    """
    wrapped = [v for v in vars(optimizer).values() if isinstance(v, torch.optim.Optimizer) and v is not optimizer]
    for opt in (optimizer, *wrapped):
        for counts in ([s.get("step") for s in opt.state.values() if isinstance(s, dict)],
                       [g.get("step") for g in opt.param_groups], [g.get("k") for g in opt.param_groups]):
            found = [n for n in map(_as_count, counts) if n is not None]
            if found:
                return max(found)
    return None


def _as_count(value: Any) -> int | None:
    """``value`` as a step count (an int, a float or a one-element tensor, finite and >= 0), else None."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return int(value)


def _without_monitor_entry(load: Any, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """The arguments of a ``load(optimizer, *args, **kwargs)`` call with the state dict's ``'monitor'``
    entry taken out, and that entry (``None`` where there is none).

    The state dict is the first argument after ``self`` of ``load``'s signature, by position or by
    its own name (``state_dict`` in torch, ``state`` in pytorch-optimizer's Lookahead); a copy of it
    without the entry replaces it. Arguments that do not bind to the signature, or a state dict that
    is not a mapping, come back unchanged, for ``load`` itself to refuse.
    """
    sig = _signature(load)
    if sig is None or len(sig.parameters) < 2:
        return args, kwargs, None
    try:
        bound = sig.bind(optimizer, *args, **kwargs)
    except TypeError:
        return args, kwargs, None
    first = list(sig.parameters.values())[1]
    value = bound.arguments.get(first.name)
    if first.kind is inspect.Parameter.VAR_POSITIONAL:
        value = value[0] if value else None
    if not isinstance(value, Mapping) or "monitor" not in value:
        return args, kwargs, None
    state_dict = {k: v for k, v in value.items() if k != "monitor"}
    if first.kind is inspect.Parameter.VAR_POSITIONAL:
        bound.arguments[first.name] = (state_dict, *bound.arguments[first.name][1:])
    else:
        bound.arguments[first.name] = state_dict
    return bound.args[1:], bound.kwargs, value["monitor"]


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _parameters(init: Any) -> list[str]:
    sig = _signature(init)
    return list(sig.parameters) if sig is not None else []


def _with_monitor_kwarg(init: Any) -> inspect.Signature | None:
    sig = _signature(init)
    if sig is None:
        return None
    params = list(sig.parameters.values())
    extra = inspect.Parameter("monitor", inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation="MonitorConfig | None")
    cut = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    return sig.replace(parameters=params[:cut] + [extra] + params[cut:])

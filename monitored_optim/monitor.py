"""The Monitor: step counting, the capture around the base step, the figures and their delivery.

Flow of one ``step()`` (see ``DESIGN.md``): a non-logging step calls the base step and counts it,
nothing else. A logging step reduces p_before and the grad to moments, lets the update view
snapshot what it needs, calls the base step once, rebuilds each update u, reduces it to moments,
copies the moments to the host once, derives the figures and hands them to the backends.
"""

from __future__ import annotations

import atexit
import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import stats
from .backends import Fanout
from .config import MonitorConfig, Settings, resolve
from .updates import Cloned, View, view_for


@dataclass
class _Entry:
    """One monitored parameter on a logging step: device moments and the view's snapshot."""

    name: str
    group: dict[str, Any]
    p: Tensor
    p_row: Tensor
    grad_row: Tensor | None
    snapshot: Any


class Monitor:
    """Counts optimizer steps and, every ``every`` steps, measures and logs each parameter's update.

    Reached as ``opt.monitor`` on a ``Monitored(...)`` optimizer; users do not build it.

    Attributes:
        step: optimizer steps completed (int; the first ``step()`` makes it 1). The x axis of every
            logged figure.
        latest: ``dict[str, float]``, tag -> value of the last logging step (empty before it).
        settings: the checked :class:`~monitored_optim.config.Settings`.

    Raises:
        ValueError, TypeError: from :func:`~monitored_optim.config.resolve` for bad configuration;
        ImportError: a requested backend's package is not installed.
    """

    def __init__(self, config: MonitorConfig | None, optimizer_cls: type[torch.optim.Optimizer]) -> None:
        self.config = config
        self.settings: Settings = resolve(config)
        _check_installed(self.settings.backends)
        _make_logdir(self.settings)
        self.view: View = view_for(optimizer_cls)
        self.step = 0
        self.latest: dict[str, float] = {}
        self._backends = Fanout(self.settings.backends, self.settings.logdir, self.settings.strict)
        self._warned_unnamed = False

    def run(self, optimizer: torch.optim.Optimizer, step_fn: Callable[..., Any],
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``step_fn(optimizer, *args, **kwargs)`` (the unhooked base step) once and monitor it.

        Returns what the base step returns (the closure's loss, if any).
        """
        if (self.step + 1) % self.settings.every:
            out = step_fn(optimizer, *args, **kwargs)
            self.step += 1
            return out
        entries = self._before(optimizer)
        args, kwargs = _record_grads_after_closure(entries, args, kwargs)
        out = step_fn(optimizer, *args, **kwargs)
        self.step += 1
        self._log(self._figures(optimizer, entries))
        return out

    def close(self) -> None:
        """Flush and close every backend (idempotent; also run at interpreter exit)."""
        self._backends.close()
        _OPEN.discard(self)

    def _names(self, optimizer: torch.optim.Optimizer) -> list[list[str]]:
        names, k = [], 0
        for group in optimizer.param_groups:
            given = group.get("param_names")
            names.append(list(given) if given else [f"param{k + i}" for i in range(len(group["params"]))])
            k += len(group["params"])
        return names

    def warn_if_unnamed(self, optimizer: torch.optim.Optimizer, stacklevel: int) -> None:
        """Warn once if a param group has no ``param_names``: figures then use ``param{k}`` names."""
        if not self._warned_unnamed and any(not g.get("param_names") for g in optimizer.param_groups):
            self._warned_unnamed = True
            warnings.warn("monitored_optim: the optimizer's parameters have no names, so figures are "
                          "logged as param0, param1, ...; pass model.named_parameters() (or param groups "
                          "whose 'params' are (name, tensor) pairs) to log them by name",
                          stacklevel=stacklevel + 1)

    @torch.no_grad()
    def _before(self, optimizer: torch.optim.Optimizer) -> list[_Entry]:
        entries = []
        for group, names in zip(optimizer.param_groups, self._names(optimizer)):
            for name, p in zip(names, group["params"]):
                grad_row = stats.moments(p.grad) if p.grad is not None else None
                snapshot = self.view.before(group, p, optimizer.state.get(p, {}))
                entries.append(_Entry(name, group, p, stats.moments(p), grad_row, snapshot))
        return entries

    @torch.no_grad()
    def _figures(self, optimizer: torch.optim.Optimizer, entries: list[_Entry]) -> dict[str, float]:
        rows, update_rows = [], []
        for e in entries:
            u = (e.snapshot.update(e.p) if isinstance(e.snapshot, Cloned)
                 else self.view.update(e.group, e.p, optimizer.state.get(e.p, {}), e.snapshot))
            update_rows.append(u is not None)
            rows += [e.p_row] + ([e.grad_row] if e.grad_row is not None else []) + ([stats.moments(u)] if u is not None else [])
            del u
        host = iter(stats.to_host(rows))
        figures: dict[str, float] = {}
        totals = {"param": 0.0, "grad": 0.0, "update": 0.0}
        for e, has_update in zip(entries, update_rows):
            n = stats.count(e.p)
            p_m = stats.Moments(n, *next(host))
            g_m = stats.Moments(n, *next(host)) if e.grad_row is not None else None
            u_m = stats.Moments(n, *next(host)) if has_update else stats.Moments(n, 0.0, 0.0)
            figures.update(_parameter_figures(e.name, p_m, g_m, u_m))
            totals["param"] += p_m.sq_norm
            totals["update"] += u_m.sq_norm
            totals["grad"] += g_m.sq_norm if g_m is not None else 0.0
        figures.update({f"global/{k}_norm": math.sqrt(v) for k, v in totals.items()})
        figures.update(_learning_rates(optimizer))
        return {tag: value for tag, value in figures.items() if math.isfinite(value)}

    def _log(self, figures: dict[str, float]) -> None:
        prefix = self.settings.prefix
        self.latest = {prefix + tag: value for tag, value in figures.items()} if prefix else figures
        _OPEN.add(self)
        self._backends.log(self.latest, self.step)


def _parameter_figures(name: str, p: stats.Moments, g: stats.Moments | None, u: stats.Moments) -> dict[str, float]:
    figures = {f"param_norm/{name}": p.norm, f"update_norm/{name}": u.norm}
    ratios = {f"update_to_data/{name}": stats.log10_ratio(u, p)}
    if g is not None:
        figures[f"grad_norm/{name}"] = g.norm
        ratios[f"grad_to_data/{name}"] = stats.log10_ratio(g, p)
    figures.update({tag: r for tag, r in ratios.items() if r is not None})
    return figures


def _learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    out = {}
    for i, group in enumerate(optimizer.param_groups):
        if "lr" in group:
            label = group["name"] if isinstance(group.get("name"), str) else f"group{i}"
            out[f"lr/{label}"] = float(group["lr"])
    return out


def _record_grads_after_closure(entries: list[_Entry], args: tuple[Any, ...],
                                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Wrap a closure so that the grad moments are those its first call produced.

    A closure-driven step (``SGD.step(closure)``, ``LBFGS``) computes the gradient inside
    ``step()``; what ``p.grad`` held before is stale or ``None``.
    """
    in_kwargs = "closure" in kwargs
    closure = kwargs["closure"] if in_kwargs else (args[0] if args else None)
    if not callable(closure):
        return args, kwargs
    done = False

    def wrapped():
        nonlocal done
        loss = closure()
        if not done:
            done = True
            with torch.no_grad():
                for e in entries:
                    e.grad_row = stats.moments(e.p.grad) if e.p.grad is not None else None
        return loss

    if in_kwargs:
        return args, {**kwargs, "closure": wrapped}
    return (wrapped, *args[1:]), kwargs


def _make_logdir(settings: Settings) -> None:
    """Create the log directory now when a file backend will write there, so that a bad path fails
    at construction rather than at the first logging step."""
    if not {"tensorboard", "jsonl"} & set(settings.backends):
        return
    try:
        settings.logdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"monitored_optim cannot create the log directory {str(settings.logdir)!r}: "
                      f"{err.strerror or err}") from err


def _check_installed(backends: tuple[str, ...]) -> None:
    import importlib.util

    package = {"tensorboard": "tensorboardX", "wandb": "wandb", "jsonl": None}
    for name in backends:
        module = package[name]
        if module and importlib.util.find_spec(module) is None:
            raise ImportError(f"monitored_optim backend {name!r} needs the {module} package: "
                              f"pip install 'monitored_optim[{name}]'")


_OPEN: "weakref.WeakSet[Monitor]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for monitor in list(_OPEN):
        monitor.close()

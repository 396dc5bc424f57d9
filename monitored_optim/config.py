"""Monitor configuration: the ``MonitorConfig`` fields and the environment variables behind them.

Precedence: a field set on ``MonitorConfig`` wins; otherwise its ``MONITORED_OPTIM_*`` environment
variable is read; otherwise the default applies. Every value is checked here, once, when the
optimizer is constructed, so that a typo fails before training starts rather than hours into it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from . import parsing
from .alerts import KINDS
from .parsing import every_parameter
from .tags import DEFAULT_FAMILIES, FAMILIES

BACKENDS = ("tensorboard", "wandb", "jsonl", "mlflow", "trackio", "swanlab", "comet")
"""Backend names accepted in ``MonitorConfig.backend`` and ``MONITORED_OPTIM_BACKEND`` (plus ``none``)."""

ENV_BACKEND = "MONITORED_OPTIM_BACKEND"
ENV_LOGDIR = "MONITORED_OPTIM_LOGDIR"
ENV_EVERY = "MONITORED_OPTIM_EVERY"
ENV_STRICT = "MONITORED_OPTIM_STRICT"
ENV_VERIFY = "MONITORED_OPTIM_VERIFY"
ENV_COUNT = "MONITORED_OPTIM_COUNT"
ENV_PARAMS = "MONITORED_OPTIM_PARAMS"
ENV_FIGURES = "MONITORED_OPTIM_FIGURES"
ENV_TAG_BUDGET = "MONITORED_OPTIM_TAG_BUDGET"
ENV_COMPILE = "MONITORED_OPTIM_COMPILE"
ENV_GUARD = "MONITORED_OPTIM_GUARD"
ENV_SKIP_BUDGET = "MONITORED_OPTIM_SKIP_BUDGET"
ENV_ALERTS = "MONITORED_OPTIM_ALERTS"
ENV_STOP_ON = "MONITORED_OPTIM_STOP_ON"
DEFAULT_TAG_BUDGET = 2000

DEFAULT_BACKEND = "tensorboard"
DEFAULT_EVERY = 10
GUARDS = ("nonfinite", "spikes")
"""What ``MonitorConfig.guard`` may judge (:mod:`monitored_optim.guard`)."""

DEFAULT_BUDGET = 5
"""Steps the guard may skip in a row before it asks to stop (``MonitorConfig.skip_budget``)."""

COUNTS = ("updates", "calls")
"""What ``MonitorConfig.count`` may count: optimizer updates (default), or ``step()`` calls
including those an AMP GradScaler skipped."""


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """What a monitored optimizer logs, where and how often.

    Pass it as ``Monitored(torch.optim.AdamW)(params, lr=1e-3, monitor=MonitorConfig(...))``.
    Each field left at ``None`` is read from its environment variable, then from the default.

    Args:
        backend: ``"tensorboard"`` (default), ``"wandb"``, ``"mlflow"``, ``"trackio"``, ``"swanlab"``,
            ``"comet"``, ``"jsonl"``, ``"none"``, a
            comma-separated string of these, or a list or tuple of names (case-insensitive), which may also hold
            your own sinks: objects with ``log(metrics, step)`` (and optionally ``close()``), or
            callables ``fn(metrics, step)`` (an alert, an early-stopping rule, a custom tracker).
            A sink gets every figure of a logging step (a ``dict[str, float]``) and the step, and
            is guarded like the built-in backends; a built-in backend's object
            (``MlflowBackend(run_id=..., client=...)``: a given MLflow run) is that backend. Environment:
            ``MONITORED_OPTIM_BACKEND`` (names).
        logdir: directory for TensorBoard event files and ``metrics.jsonl``. Default, as
            TensorBoard's ``SummaryWriter``: ``runs/<Mon><DD>_<HH-MM-SS>_<hostname>`` under the
            working directory. Environment: ``MONITORED_OPTIM_LOGDIR``.
        every: log on optimizer steps where ``step % every == 0`` (int >= 1, default 10, since a
            logging step costs several plain steps: the README's "Cost"; the first step is step 1).
            Environment: ``MONITORED_OPTIM_EVERY``.
        prefix: prepended as ``"{prefix}/"`` to every tag, so that several optimizers (a GAN's
            generator and discriminator) can share a log directory and a W&B run. Letters, digits,
            ``_ . -`` only; default none.
        strict: ``True`` raises when a backend fails at run time; ``False`` (default) warns once
            naming the backend and the error, stops using that backend and keeps training.
            Environment: ``MONITORED_OPTIM_STRICT`` (``1``/``true``/``yes`` or ``0``/``false``/``no``).
        verify: ``True`` also clones every parameter on logging steps, compares the state-aware
            update with the clone's, logs ``verify/max_rel_error`` and warns naming any parameter
            beyond tolerance. Run it once after upgrading torch. Environment:
            ``MONITORED_OPTIM_VERIFY``; default off.
        model: a ``torch.nn.Module`` to watch (same as ``opt.monitor.watch(model)``): each of its
            trainable parameters that no param group contains is warned about once, and parameters
            that a param group holds without a name (bare tensors, as nanoGPT's and the Hugging
            Face Trainer's groups hold them) are named as ``model.named_parameters()`` names them,
            less the wrappers' parts (DDP's ``module.``, FSDP1's ``_fsdp_wrapped_module.``: a wrapped
            model's layers have the plain model's names). Not saved when the optimizer is pickled.
        params: which parameters are monitored: a glob on parameter names (``fnmatch`` rules,
            ``"transformer.h.3.*"``), a list of globs, where one starting with ``!`` leaves out what
            it matches, or a callable ``(name, param) -> bool``. Default: all. A parameter left out
            costs nothing on any step and appears in no tag; ``health/*`` counts what is
            monitored. Environment: ``MONITORED_OPTIM_PARAMS`` (comma-separated globs).
        exclude: globs of parameter names to leave out (as ``!`` globs in ``params``).
        figures: which figure families are computed and sent: a comma-separated string or a list
            from ``update_to_data``, ``grad_to_data``, ``norms``, ``lr``, ``health``,
            ``update_lost``, ``spikes``, ``monitor`` (the monitor's own cost), ``state``,
            ``spectral``, ``histograms``, or ``"all"``; ``default`` stands for the default families
            (``"default,histograms"`` adds the histograms to them). Default: all but ``state``,
            ``spectral`` and ``histograms``. Environment: ``MONITORED_OPTIM_FIGURES``.
        tag_budget: the most tags one logging step sends to the dashboards (TensorBoard, W&B, MLflow,
            trackio, SwanLab, Comet; a histogram counts as one; int >= 1,
            default 2000); above it, parameters whose names differ only in a layer index are sent
            as min, median and max over depth (see the README's "Many parameters"), while
            ``metrics.jsonl`` keeps every per-parameter figure. Environment:
            ``MONITORED_OPTIM_TAG_BUDGET``.
        count: the x axis, ``opt.monitor.step``: ``"updates"`` (default) counts optimizer updates,
            so a step that an AMP GradScaler skipped does not count; ``"calls"`` counts every
            ``scaler.step(opt)`` / ``opt.step()`` call, skipped ones included, which is what the
            Hugging Face Trainer's and Lightning's global step count. Environment:
            ``MONITORED_OPTIM_COUNT``.
        compile: the fused capture (:mod:`monitored_optim.capture.fused`): ``True`` compiles each chunk's
            rebuild and sums with ``torch.compile`` (one pass over p, grad and state; the first
            logging step pays the compile), ``False`` keeps the eager capture, ``"auto"`` (default)
            fuses on CUDA devices only. Environment: ``MONITORED_OPTIM_COMPILE`` (``1``, ``0`` or
            ``auto``).
        guard: skip a step whose grads are poisoned, for any optimizer (:mod:`monitored_optim.guard`):
            ``"nonfinite"`` (a NaN or an Inf in a monitored parameter's grad), ``"spikes"`` (a grad
            norm far above its recent steps, the ``health/spikes`` rule judged at every step), both
            (``"nonfinite,spikes"``), or ``"none"`` (default). The base step is then not called, as
            ``GradScaler`` does: parameters and state stay bit for bit; ``guard/skipped`` counts the
            skipped steps, ``opt.monitor.step_was_skipped`` tells of the last one. Costs one host sync
            per step (and under ``torch.distributed`` one small collective). Environment:
            ``MONITORED_OPTIM_GUARD``.
        skip_budget: steps the guard may skip in a row (int >= 1, default 5); one more is a
            ``stalled`` event, told at ERROR level, and asks to stop (``opt.monitor.should_stop``).
            Environment: ``MONITORED_OPTIM_SKIP_BUDGET``.
        alerts: the events told to a person (:mod:`monitored_optim.alerts`): a comma-separated
            string or a list from ``nonfinite``, ``spikes``, ``skipped``, ``stalled``, ``unchanged``,
            ``no_grad``, or ``"all"``; default none. Each is one record on the logger
            ``monitored_optim.alerts`` and, where the figures go to W&B, trackio or Comet, their
            alert call; at most one per kind every 10 minutes. Environment: ``MONITORED_OPTIM_ALERTS``.
        stop_on: the events after which ``opt.monitor.should_stop`` is True on every rank (same
            names as ``alerts``); the trainers' callbacks then stop the trainer. Default none.
            Environment: ``MONITORED_OPTIM_STOP_ON``.

    Raises:
        ValueError: from :func:`resolve` (at optimizer construction) for a value of the wrong
            type or outside the ranges above (an explicit field takes Python values: ``every=10``,
            not ``"10"``; strings are for the environment), naming the field or variable, the value
            and what is allowed.
    """

    backend: str | Sequence[str] | None = None
    logdir: str | os.PathLike[str] | None = None
    every: int | None = None
    prefix: str | None = None
    strict: bool | None = None
    verify: bool | None = None
    model: Any = None
    count: str | None = None
    params: str | Sequence[str] | Callable[[str, torch.Tensor], bool] | None = None
    exclude: str | Sequence[str] | None = None
    figures: str | Sequence[str] | None = None
    tag_budget: int | None = None
    compile: bool | str | None = None
    guard: str | Sequence[str] | None = None
    skip_budget: int | None = None
    alerts: str | Sequence[str] | None = None
    stop_on: str | Sequence[str] | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """A checked configuration: backend names (possibly empty), log directory, period, tag prefix
    (``""`` or ending in ``/``) and strictness."""

    backends: tuple[str, ...]
    logdir: Path
    every: int
    prefix: str = ""
    strict: bool = False
    verify: bool = False
    count: str = "updates"
    sinks: tuple[Any, ...] = ()
    select: Callable[[str, torch.Tensor], bool] = every_parameter
    figures: frozenset[str] = frozenset(DEFAULT_FAMILIES)
    tag_budget: int = DEFAULT_TAG_BUDGET
    compile: str = "auto"
    guard: frozenset[str] = frozenset()
    skip_budget: int = DEFAULT_BUDGET
    alerts: frozenset[str] = frozenset()
    stop_on: frozenset[str] = frozenset()


def resolve(config: MonitorConfig | None, environ: Mapping[str, str] | None = None) -> Settings:
    """Merge ``config`` with the environment and check every value.

    Args:
        config: explicit settings; ``None`` means all from the environment.
        environ: the environment to read (default ``os.environ``). An empty variable counts as unset.

    Returns:
        Settings with a tuple of backend names from :data:`BACKENDS` (empty for ``none``), the log
        directory as a ``Path`` (not created here) and ``every`` as an int >= 1.

    Raises:
        TypeError: ``config`` is not a ``MonitorConfig`` or ``None``.
        ValueError: a bad value, with its source (field or variable), the value and what is allowed.
    """
    if config is None:
        config = MonitorConfig()
    if not isinstance(config, MonitorConfig):
        raise TypeError(f"monitor= expects a monitored_optim.MonitorConfig or None, got {config!r}")
    if config.model is not None and not isinstance(config.model, torch.nn.Module):
        raise ValueError(f"MonitorConfig.model={config.model!r} is not valid: expected a torch.nn.Module")
    env = os.environ if environ is None else environ
    backend, backend_src = parsing.pick(config.backend, "MonitorConfig.backend", env, ENV_BACKEND)
    logdir, logdir_src = parsing.pick(config.logdir, "MonitorConfig.logdir", env, ENV_LOGDIR)
    every, every_src = parsing.pick(config.every, "MonitorConfig.every", env, ENV_EVERY)
    strict, strict_src = parsing.pick(config.strict, "MonitorConfig.strict", env, ENV_STRICT)
    verify, verify_src = parsing.pick(config.verify, "MonitorConfig.verify", env, ENV_VERIFY)
    count, count_src = parsing.pick(config.count, "MonitorConfig.count", env, ENV_COUNT)
    params, params_src = parsing.pick(config.params, "MonitorConfig.params", env, ENV_PARAMS)
    figures, figures_src = parsing.pick(config.figures, "MonitorConfig.figures", env, ENV_FIGURES)
    budget, budget_src = parsing.pick(config.tag_budget, "MonitorConfig.tag_budget", env, ENV_TAG_BUDGET)
    compiled, compile_src = parsing.pick(config.compile, "MonitorConfig.compile", env, ENV_COMPILE)
    guard, guard_src = parsing.pick(config.guard, "MonitorConfig.guard", env, ENV_GUARD)
    skips, skips_src = parsing.pick(config.skip_budget, "MonitorConfig.skip_budget", env, ENV_SKIP_BUDGET)
    alerts, alerts_src = parsing.pick(config.alerts, "MonitorConfig.alerts", env, ENV_ALERTS)
    stop_on, stop_src = parsing.pick(config.stop_on, "MonitorConfig.stop_on", env, ENV_STOP_ON)
    _check_types(config)
    sinks = parsing.sinks(backend)
    if sinks:
        backend = [b for b in backend if isinstance(b, str)] or "none"
    settings = Settings(
        sinks=sinks,
        backends=parsing.backends(DEFAULT_BACKEND if backend is None else backend, backend_src, BACKENDS),
        logdir=parsing.logdir(logdir, logdir_src) if logdir is not None else default_logdir(),
        every=DEFAULT_EVERY if every is None else parsing.every(every, every_src),
        prefix=parsing.prefix(config.prefix),
        strict=False if strict is None else parsing.flag(strict, strict_src),
        verify=False if verify is None else parsing.flag(verify, verify_src),
        count="updates" if count is None else parsing.count(count, count_src, COUNTS),
        select=parsing.selection(params, params_src, config.exclude),
        figures=frozenset(DEFAULT_FAMILIES) if figures is None else parsing.figures(figures, figures_src),
        tag_budget=DEFAULT_TAG_BUDGET if budget is None else parsing.budget(budget, budget_src),
        compile="auto" if compiled is None else parsing.compiled(compiled, compile_src),
        guard=frozenset() if guard is None else parsing.kinds(guard, guard_src, GUARDS, every=False),
        skip_budget=DEFAULT_BUDGET if skips is None else parsing.at_least_one(skips, skips_src, "skip budget"),
        alerts=frozenset() if alerts is None else parsing.kinds(alerts, alerts_src, tuple(KINDS), every=True),
        stop_on=frozenset() if stop_on is None else parsing.kinds(stop_on, stop_src, tuple(KINDS), every=True),
    )
    return _narrowed(settings, config, (alerts, alerts_src), (stop_on, stop_src))


def _narrowed(settings: Settings, config: MonitorConfig, alerts: tuple[Any, str], stop_on: tuple[Any, str]
              ) -> Settings:
    """``settings`` with ``alerts`` and ``stop_on`` (each its raw value and source) of ``all`` narrowed
    to the kinds the configuration finds (:func:`heard`).

    Raises:
        ValueError: ``skip_budget`` set without the guard; alerts or stops asked on a kind never found.
    """
    if config.skip_budget is not None and not settings.guard:
        raise ValueError(f"MonitorConfig.skip_budget={config.skip_budget!r} has no effect without the guard: set "
                         "MonitorConfig(guard='nonfinite') too, or leave skip_budget out")
    found = heard(settings)
    every = {field: getattr(settings, field) & found
             for field, (value, _) in (("alerts", alerts), ("stop_on", stop_on)) if parsing.is_all(value)}
    settings = dataclasses.replace(settings, **every)  # 'all': every kind this configuration finds
    _check_heard(found, (alerts[1], settings.alerts), (stop_on[1], settings.stop_on))
    return settings


_FIELD_TYPES = {
    "backend": ((str, list, tuple), f"one of {', '.join(BACKENDS)}, none, as a string (commas between names) "
                                    "or a list of them"),
    "logdir": ((str, os.PathLike), "a path (str or os.PathLike)"),
    "every": ((int,), "an integer >= 1"),
    "prefix": ((str,), "a string of letters, digits, '_', '.' or '-'"),
    "strict": ((bool,), "True or False"),
    "verify": ((bool,), "True or False"),
    "count": ((str,), f"one of {', '.join(COUNTS)}"),
    "params": ((str, list, tuple), "a glob, a list of globs ('!' to leave out) or a callable (name, param) -> bool"),
    "exclude": ((str, list, tuple), "a glob or a list of globs"),
    "figures": ((str, list, tuple), f"'all' or some of {', '.join(FAMILIES)}"),
    "tag_budget": ((int,), "an integer >= 1"),
    "compile": ((bool, str), "True, False or 'auto'"),
    "guard": ((str, list, tuple), f"'none' or some of {', '.join(GUARDS)}, as a string (commas between) or a list"),
    "skip_budget": ((int,), "an integer >= 1"),
    "alerts": ((str, list, tuple), f"'none', 'all' or some of {', '.join(KINDS)}, as a string or a list"),
    "stop_on": ((str, list, tuple), f"'none', 'all' or some of {', '.join(KINDS)}, as a string or a list"),
}
"""The Python types each explicit ``MonitorConfig`` field takes, and how the error names them."""


def _check_types(config: MonitorConfig) -> None:
    """Refuse an explicit field of the wrong type (``every="10"``, ``strict="yes"``, ``every=True``)."""
    for field, (types, allowed) in _FIELD_TYPES.items():
        value = getattr(config, field)
        if value is None or (field == "params" and callable(value)) or (field == "backend" and parsing.is_sink(value)):
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"MonitorConfig.{field}={value!r} is not valid ({type(value).__name__}): "
                             f"expected {allowed}")


def default_logdir() -> Path:
    """TensorBoard's default run directory, ``runs/<Mon><DD>_<HH-MM-SS>_<hostname>`` (as tensorboardX)."""
    stamp = datetime.datetime.now().strftime("%b%d_%H-%M-%S")
    return Path("runs") / f"{stamp}_{socket.gethostname()}"


def heard(settings: Settings) -> frozenset[str]:
    """The event kinds ``settings`` can find: ``nonfinite``, ``unchanged`` and ``no_grad`` with the
    ``health`` figures, ``spikes`` with the ``spikes`` figures, and what the guard finds."""
    found = {"nonfinite", "unchanged", "no_grad"} if "health" in settings.figures else set()
    if "spikes" in settings.figures or "spikes" in settings.guard:
        found.add("spikes")
    if settings.guard:
        found |= {"skipped", "stalled", *settings.guard}
    return frozenset(found)


def _check_heard(found: frozenset[str], *asked: tuple[str, frozenset[str]]) -> None:
    """Refuse alerts or stops on an event kind that the configuration never finds (``found``:
    :func:`heard`; ``asked``: the source of each setting and its kinds)."""
    for source, kinds in asked:
        for kind in sorted(kinds - found):
            needs = ("MonitorConfig.guard (guard='nonfinite')" if kind in ("skipped", "stalled") else
                     "the 'spikes' figures or guard='spikes'" if kind == "spikes" else "the 'health' figures")
            raise ValueError(f"{source} asks for {kind!r}, which this configuration never finds: it needs {needs}; "
                             f"what it finds now: {', '.join(sorted(found)) or 'nothing'}")

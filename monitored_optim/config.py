"""Monitor configuration: the ``MonitorConfig`` fields and the environment variables behind them.

Precedence: a field set on ``MonitorConfig`` wins; otherwise its ``MONITORED_OPTIM_*`` environment
variable is read; otherwise the default applies. Every value is checked here, once, when the
optimizer is constructed, so that a typo fails before training starts rather than hours into it.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import fnmatch
import functools
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .alerts import KINDS
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
def every_parameter(name: str, p: torch.Tensor) -> bool:
    """The parameter selection of no ``params`` and no ``exclude``: every parameter (True)."""
    return True


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
    backend, backend_src = _pick(config.backend, "MonitorConfig.backend", env, ENV_BACKEND)
    logdir, logdir_src = _pick(config.logdir, "MonitorConfig.logdir", env, ENV_LOGDIR)
    every, every_src = _pick(config.every, "MonitorConfig.every", env, ENV_EVERY)
    strict, strict_src = _pick(config.strict, "MonitorConfig.strict", env, ENV_STRICT)
    verify, verify_src = _pick(config.verify, "MonitorConfig.verify", env, ENV_VERIFY)
    count, count_src = _pick(config.count, "MonitorConfig.count", env, ENV_COUNT)
    params, params_src = _pick(config.params, "MonitorConfig.params", env, ENV_PARAMS)
    figures, figures_src = _pick(config.figures, "MonitorConfig.figures", env, ENV_FIGURES)
    budget, budget_src = _pick(config.tag_budget, "MonitorConfig.tag_budget", env, ENV_TAG_BUDGET)
    compiled, compile_src = _pick(config.compile, "MonitorConfig.compile", env, ENV_COMPILE)
    guard, guard_src = _pick(config.guard, "MonitorConfig.guard", env, ENV_GUARD)
    skips, skips_src = _pick(config.skip_budget, "MonitorConfig.skip_budget", env, ENV_SKIP_BUDGET)
    alerts, alerts_src = _pick(config.alerts, "MonitorConfig.alerts", env, ENV_ALERTS)
    stop_on, stop_src = _pick(config.stop_on, "MonitorConfig.stop_on", env, ENV_STOP_ON)
    _check_types(config)
    sinks = _sinks(backend)
    if sinks:
        backend = [b for b in backend if isinstance(b, str)] or "none"
    settings = Settings(
        sinks=sinks,
        backends=_parse_backends(DEFAULT_BACKEND if backend is None else backend, backend_src),
        logdir=_parse_logdir(logdir, logdir_src) if logdir is not None else default_logdir(),
        every=DEFAULT_EVERY if every is None else _parse_every(every, every_src),
        prefix=_parse_prefix(config.prefix),
        strict=False if strict is None else _parse_flag(strict, strict_src),
        verify=False if verify is None else _parse_flag(verify, verify_src),
        count="updates" if count is None else _parse_count(count, count_src),
        select=_parse_selection(params, params_src, config.exclude),
        figures=frozenset(DEFAULT_FAMILIES) if figures is None else _parse_figures(figures, figures_src),
        tag_budget=DEFAULT_TAG_BUDGET if budget is None else _parse_budget(budget, budget_src),
        compile="auto" if compiled is None else _parse_compile(compiled, compile_src),
        guard=frozenset() if guard is None else _parse_kinds(guard, guard_src, GUARDS),
        skip_budget=DEFAULT_BUDGET if skips is None else _parse_count_at_least_one(skips, skips_src, "skip budget"),
        alerts=frozenset() if alerts is None else _parse_kinds(alerts, alerts_src, tuple(KINDS)),
        stop_on=frozenset() if stop_on is None else _parse_kinds(stop_on, stop_src, tuple(KINDS)),
    )
    if config.skip_budget is not None and not settings.guard:
        raise ValueError(f"MonitorConfig.skip_budget={config.skip_budget!r} has no effect without the guard: set "
                         "MonitorConfig(guard='nonfinite') too, or leave skip_budget out")
    found = heard(settings)
    every = {field: getattr(settings, field) & found for field, value in (("alerts", alerts), ("stop_on", stop_on))
             if _is_all(value)}  # 'all': every kind this configuration finds
    settings = dataclasses.replace(settings, **every)
    _check_heard(found, (alerts_src, settings.alerts), (stop_src, settings.stop_on))
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
        if value is None or (field == "params" and callable(value)) or (field == "backend" and is_sink(value)):
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"MonitorConfig.{field}={value!r} is not valid ({type(value).__name__}): "
                             f"expected {allowed}")


def default_logdir() -> Path:
    """TensorBoard's default run directory, ``runs/<Mon><DD>_<HH-MM-SS>_<hostname>`` (as tensorboardX)."""
    stamp = datetime.datetime.now().strftime("%b%d_%H-%M-%S")
    return Path("runs") / f"{stamp}_{socket.gethostname()}"


def _pick(value, field: str, env: Mapping[str, str], var: str):
    """The explicit value with its field name, else the environment's (empty = unset) with its variable."""
    if value is not None:
        return value, field
    raw = env.get(var, "")
    return (raw, var) if raw.strip() else (None, var)


def is_sink(obj: Any) -> bool:
    """Whether ``obj`` is a user sink: an object with a ``log(metrics, step)`` method, or a callable
    ``fn(metrics, step)`` (not a backend name)."""
    return not isinstance(obj, str) and (callable(getattr(obj, "log", None)) or callable(obj))


def _sinks(value: Any) -> tuple[Any, ...]:
    """The user sinks in ``MonitorConfig.backend`` (a list may mix them with backend names)."""
    if is_sink(value):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(v for v in value if is_sink(v))
    return ()


def _parse_backends(value: str | Sequence[str], source: str) -> tuple[str, ...]:
    allowed = f"one of {', '.join(BACKENDS)}, none, or a comma-separated list of them"
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{source}={value!r} is not a valid backend: expected {allowed}")
    names = [n.strip().lower() for n in names]
    if names == ["none"]:
        return ()
    if "none" in names:
        raise ValueError(f"{source}={value!r} combines 'none' with other backends: expected {allowed}")
    bad = [n for n in names if n not in BACKENDS]
    if bad:
        raise ValueError(f"{source}={value!r} is not a valid backend ({bad[0]!r} is unknown): expected {allowed}")
    return tuple(dict.fromkeys(names))


def _parse_logdir(value: Any, source: str) -> Path:
    if isinstance(value, str):
        value = value.strip()
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise ValueError(f"{source}={value!r} is not a valid log directory: expected a path (str or os.PathLike)")
    return Path(value).expanduser()


def _parse_every(value: int | str, source: str) -> int:
    if isinstance(value, bool):
        every = None
    elif isinstance(value, int):
        every = value
    else:
        try:
            every = int(str(value).strip())
        except ValueError:
            every = None
    if every is None or every < 1:
        raise ValueError(f"{source}={value!r} is not a valid logging period: expected an integer >= 1")
    return every


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_flag(value: bool | str, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE + _FALSE:
        return text in _TRUE
    raise ValueError(f"{source}={value!r} is not a valid flag: expected one of {', '.join(_TRUE + _FALSE)}")


def _parse_compile(value: bool | str, source: str) -> str:
    """``"on"``, ``"off"`` or ``"auto"`` from a flag or ``auto``."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and source.startswith("MonitorConfig"):
        raise ValueError(f"{source}={value!r} is not valid (str): expected True, False or 'auto'")
    try:
        return "on" if _parse_flag(value, source) else "off"
    except ValueError:
        raise ValueError(f"{source}={value!r} is not valid: expected auto or one of "
                         f"{', '.join(_TRUE + _FALSE)}") from None


def _parse_count(value: str, source: str) -> str:
    text = str(value).strip().lower()
    if text not in COUNTS:
        raise ValueError(f"{source}={value!r} is not a valid step count: expected one of {', '.join(COUNTS)}")
    return text


def _globs(value: str | Sequence[str], source: str) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(g, str) and g.strip() for g in items) or not items:
        raise ValueError(f"{source}={value!r} is not valid: expected a glob on parameter names or a list of them")
    return [g.strip() for g in items]


def _parse_selection(params: Any, source: str, exclude: Any) -> Callable[[str, torch.Tensor], bool]:
    """The predicate ``(name, param) -> bool`` of ``params`` and ``exclude`` (see :class:`MonitorConfig`)."""
    out = [] if exclude is None else _globs(exclude, "MonitorConfig.exclude")
    if callable(params):
        return lambda name, p: bool(params(name, p)) and not any(fnmatch.fnmatchcase(name, g) for g in out)
    globs = [] if params is None else _globs(params, source)
    out += [g[1:] for g in globs if g.startswith("!")]
    keep = [g for g in globs if not g.startswith("!")]
    if not keep and not out:
        return every_parameter

    @functools.lru_cache(maxsize=1 << 16)  # names repeat at every logging step
    def chosen(name: str) -> bool:
        return ((not keep or any(fnmatch.fnmatchcase(name, g) for g in keep))
                and not any(fnmatch.fnmatchcase(name, g) for g in out))

    return lambda name, p: chosen(name)


def _parse_figures(value: str | Sequence[str], source: str) -> frozenset[str]:
    names = [n.strip().lower() for n in (value.split(",") if isinstance(value, str) else value)]
    if names == ["all"]:
        return frozenset(FAMILIES)
    bad = [n for n in names if n not in FAMILIES and n != "default"]
    if bad or not names:
        raise ValueError(f"{source}={value!r} is not valid ({bad[0]!r} is unknown): expected 'all' or some of "
                         f"default, {', '.join(FAMILIES)}" if bad else f"{source}={value!r} names no figure family")
    return frozenset(n for name in names for n in (DEFAULT_FAMILIES if name == "default" else (name,)))


def _parse_budget(value: int | str, source: str) -> int:
    return _parse_count_at_least_one(value, source, "tag budget")


def _parse_count_at_least_one(value: int | str, source: str, what: str) -> int:
    """``value`` as an int >= 1 (``what`` it is, for the error)."""
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else 0
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{source}={value!r} is not a valid {what}: expected an integer >= 1")
    return number


def heard(settings: Settings) -> frozenset[str]:
    """The event kinds ``settings`` can find: ``nonfinite``, ``unchanged`` and ``no_grad`` with the
    ``health`` figures, ``spikes`` with the ``spikes`` figures, and what the guard finds."""
    found = {"nonfinite", "unchanged", "no_grad"} if "health" in settings.figures else set()
    if "spikes" in settings.figures or "spikes" in settings.guard:
        found.add("spikes")
    if settings.guard:
        found |= {"skipped", "stalled", *settings.guard}
    return frozenset(found)


def _is_all(value: Any) -> bool:
    """Whether a kinds setting is ``all`` (a string, or a list of that one name)."""
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    return [str(v).strip().lower() for v in items] == ["all"]


def _check_heard(found: frozenset[str], *asked: tuple[str, frozenset[str]]) -> None:
    """Refuse alerts or stops on an event kind that the configuration never finds (``found``:
    :func:`heard`; ``asked``: the source of each setting and its kinds)."""
    for source, kinds in asked:
        for kind in sorted(kinds - found):
            needs = ("MonitorConfig.guard (guard='nonfinite')" if kind in ("skipped", "stalled") else
                     "the 'spikes' figures or guard='spikes'" if kind == "spikes" else "the 'health' figures")
            raise ValueError(f"{source} asks for {kind!r}, which this configuration never finds: it needs {needs}; "
                             f"what it finds now: {', '.join(sorted(found)) or 'nothing'}")


def _parse_kinds(value: str | Sequence[str], source: str, allowed: tuple[str, ...]) -> frozenset[str]:
    """The kinds a comma-separated string or a list names, of ``allowed`` (``none``: no kind; ``all``:
    every one where the allowed are event kinds, which :func:`resolve` narrows to those the
    configuration finds).

    Raises:
        ValueError: an unknown or misspelt kind (naming the nearest), or ``none`` beside others.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    accepted = f"'none'{', all' if allowed != GUARDS else ''} or some of {', '.join(allowed)}"
    if not all(isinstance(n, str) for n in items):
        raise ValueError(f"{source}={value!r} is not valid: expected {accepted}, as names (strings)")
    names = [n for n in (n.strip().lower() for n in items) if n]
    if names in ([], ["none"]):
        return frozenset()
    if names == ["all"] and allowed != GUARDS:
        return frozenset(allowed)
    for name in names:
        if name not in allowed:
            near = difflib.get_close_matches(name, allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"{source}={value!r} is not valid ({name!r} is unknown{hint}): expected {accepted}")
    return frozenset(names)


def _parse_prefix(value: str | None) -> str:
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not all(c.isalnum() or c in "_.-" for c in value):
        raise ValueError(f"MonitorConfig.prefix={value!r} is not a valid tag prefix: "
                         "expected letters, digits, '_', '.' or '-'")
    return value + "/"

"""The checks of one setting's value: each turns an explicit field or an environment variable into
the checked value :class:`~monitored_optim.config.Settings` holds, or raises ``ValueError`` naming
the source (field or variable), the value and what is allowed."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .tags import DEFAULT_FAMILIES, FAMILIES


def every_parameter(name: str, p: torch.Tensor) -> bool:
    """The parameter selection of no ``params`` and no ``exclude``: every parameter (True)."""
    return True


def pick(value, field: str, env: Mapping[str, str], var: str):
    """The explicit value with its field name, else the environment's (empty = unset) with its variable."""
    if value is not None:
        return value, field
    raw = env.get(var, "")
    return (raw, var) if raw.strip() else (None, var)


def is_sink(obj: Any) -> bool:
    """Whether ``obj`` is a user sink: an object with a ``log(metrics, step)`` method, or a callable
    ``fn(metrics, step)`` (not a backend name)."""
    return not isinstance(obj, str) and (callable(getattr(obj, "log", None)) or callable(obj))


def sinks(value: Any) -> tuple[Any, ...]:
    """The user sinks in ``MonitorConfig.backend`` (a list may mix them with backend names)."""
    if is_sink(value):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(v for v in value if is_sink(v))
    return ()


def backends(value: str | Sequence[str], source: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """The backend names ``value`` gives, of ``known`` (``none``: no backend; duplicates once)."""
    allowed = f"one of {', '.join(known)}, none, or a comma-separated list of them"
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{source}={value!r} is not a valid backend: expected {allowed}")
    names = [n.strip().lower() for n in names]
    if names == ["none"]:
        return ()
    if "none" in names:
        raise ValueError(f"{source}={value!r} combines 'none' with other backends: expected {allowed}")
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"{source}={value!r} is not a valid backend ({bad[0]!r} is unknown): expected {allowed}")
    return tuple(dict.fromkeys(names))


def logdir(value: Any, source: str) -> Path:
    """The log directory ``value`` names, ``~`` expanded (not created here)."""
    if isinstance(value, str):
        value = value.strip()
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise ValueError(f"{source}={value!r} is not a valid log directory: expected a path (str or os.PathLike)")
    return Path(value).expanduser()


def every(value: int | str, source: str) -> int:
    """The logging period, an int >= 1."""
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


def flag(value: bool | str, source: str) -> bool:
    """A flag: a bool, or one of ``1 true yes on`` / ``0 false no off`` (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE + _FALSE:
        return text in _TRUE
    raise ValueError(f"{source}={value!r} is not a valid flag: expected one of {', '.join(_TRUE + _FALSE)}")


def compiled(value: bool | str, source: str) -> str:
    """``"on"``, ``"off"`` or ``"auto"`` from a flag or ``auto``."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and source.startswith("MonitorConfig"):
        raise ValueError(f"{source}={value!r} is not valid (str): expected True, False or 'auto'")
    try:
        return "on" if flag(value, source) else "off"
    except ValueError:
        raise ValueError(f"{source}={value!r} is not valid: expected auto or one of "
                         f"{', '.join(_TRUE + _FALSE)}") from None


def count(value: str, source: str, known: tuple[str, ...]) -> str:
    """What the step count counts, of ``known``."""
    text = str(value).strip().lower()
    if text not in known:
        raise ValueError(f"{source}={value!r} is not a valid step count: expected one of {', '.join(known)}")
    return text


def globs(value: str | Sequence[str], source: str) -> list[str]:
    """The globs of a comma-separated string or a list, stripped, none empty."""
    items = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(g, str) and g.strip() for g in items) or not items:
        raise ValueError(f"{source}={value!r} is not valid: expected a glob on parameter names or a list of them")
    return [g.strip() for g in items]


def selection(params: Any, source: str, exclude: Any) -> Callable[[str, torch.Tensor], bool]:
    """The predicate ``(name, param) -> bool`` of ``params`` and ``exclude`` (see
    :class:`~monitored_optim.config.MonitorConfig`)."""
    out = [] if exclude is None else globs(exclude, "MonitorConfig.exclude")
    if callable(params):
        return lambda name, p: bool(params(name, p)) and not any(fnmatch.fnmatchcase(name, g) for g in out)
    patterns = [] if params is None else globs(params, source)
    out += [g[1:] for g in patterns if g.startswith("!")]
    keep = [g for g in patterns if not g.startswith("!")]
    if not keep and not out:
        return every_parameter

    @functools.lru_cache(maxsize=1 << 16)  # names repeat at every logging step
    def chosen(name: str) -> bool:
        return ((not keep or any(fnmatch.fnmatchcase(name, g) for g in keep))
                and not any(fnmatch.fnmatchcase(name, g) for g in out))

    return lambda name, p: chosen(name)


def figures(value: str | Sequence[str], source: str) -> frozenset[str]:
    """The figure families ``value`` names (``all``; ``default`` for the default ones)."""
    names = [n.strip().lower() for n in (value.split(",") if isinstance(value, str) else value)]
    if names == ["all"]:
        return frozenset(FAMILIES)
    bad = [n for n in names if n not in FAMILIES and n != "default"]
    if bad or not names:
        raise ValueError(f"{source}={value!r} is not valid ({bad[0]!r} is unknown): expected 'all' or some of "
                         f"default, {', '.join(FAMILIES)}" if bad else f"{source}={value!r} names no figure family")
    return frozenset(n for name in names for n in (DEFAULT_FAMILIES if name == "default" else (name,)))


def budget(value: int | str, source: str) -> int:
    """The tag budget, an int >= 1."""
    return at_least_one(value, source, "tag budget")


def at_least_one(value: int | str, source: str, what: str) -> int:
    """``value`` as an int >= 1 (``what`` it is, for the error)."""
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else 0
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{source}={value!r} is not a valid {what}: expected an integer >= 1")
    return number


def is_all(value: Any) -> bool:
    """Whether a kinds setting is ``all`` (a string, or a list of that one name)."""
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    return [str(v).strip().lower() for v in items] == ["all"]


def kinds(value: str | Sequence[str], source: str, allowed: tuple[str, ...], every: bool) -> frozenset[str]:
    """The kinds a comma-separated string or a list names, of ``allowed`` (``none``: no kind; ``all``,
    where ``every``: all of them, which :func:`~monitored_optim.config.resolve` narrows to those the
    configuration finds).

    Raises:
        ValueError: an unknown or misspelt kind (naming the nearest), or ``none`` beside others.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    accepted = f"'none'{', all' if every else ''} or some of {', '.join(allowed)}"
    if not all(isinstance(n, str) for n in items):
        raise ValueError(f"{source}={value!r} is not valid: expected {accepted}, as names (strings)")
    names = [n for n in (n.strip().lower() for n in items) if n]
    if names in ([], ["none"]):
        return frozenset()
    if names == ["all"] and every:
        return frozenset(allowed)
    for name in names:
        if name not in allowed:
            near = difflib.get_close_matches(name, allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"{source}={value!r} is not valid ({name!r} is unknown{hint}): expected {accepted}")
    return frozenset(names)


def prefix(value: str | None) -> str:
    """The tag prefix with its ``/`` (``""`` for none)."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not all(c.isalnum() or c in "_.-" for c in value):
        raise ValueError(f"MonitorConfig.prefix={value!r} is not a valid tag prefix: "
                         "expected letters, digits, '_', '.' or '-'")
    return value + "/"

"""The one error the report raises, the check for its optional packages, and the bounded quoting of
input and causes in its messages."""

from __future__ import annotations

import importlib
import reprlib
from types import ModuleType

INSTALL = "pip install 'monitored_optim[report]'"
QUOTED = 40
"""Characters of a value read from a run that an error message quotes at most."""
REASON = 120
"""Characters of an exception's message that an error message gives at most."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, QUOTED, QUOTED, QUOTED


class ReportError(Exception):
    """A run cannot be read or rendered; ``str(error)`` is one line naming the path and the cause.

    The command line prints it on stderr and exits with status 1, without a traceback.
    """


def require(module: str, package: str) -> ModuleType:
    """Import ``module`` (from the distribution ``package``) or say which extra installs it.

    Returns:
        The imported module.

    Raises:
        ReportError: the package is not installed; the message names ``package`` and
            ``pip install 'monitored_optim[report]'``.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ReportError(f"the report needs the {package} package: {INSTALL}") from None


def quote(value: object) -> str:
    """``repr(value)`` in at most :data:`QUOTED` characters, with "..." where it was cut.

    For error messages that quote what a run holds: the work and the text stay bounded whatever the
    value (a 50 MB string, a list nested hundreds deep); a long string keeps its start and its end.
    """
    return _cut(_REPR.repr(value), QUOTED)


def reason(exc: BaseException) -> str:
    """``"{type}: {message}"`` of ``exc`` on one line of at most :data:`REASON` characters (the first
    line of its message, cut with "...")."""
    text = str(exc).strip().splitlines()
    return _cut(f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__, REASON)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."

"""The one error the report raises, and the check for its optional packages."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "pip install 'monitored_optim[report]'"


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

"""Tag names: the figure families, and which tags hold one figure per parameter.

A tag is ``[{prefix}/]{head}/{rest}``. A per-parameter tag's rest is the parameter's name, or, for a
*keyed* head, a key and the name (``state_norm/exp_avg/fc1.weight``: the norm of the state tensor
``exp_avg`` of ``fc1.weight``). Its *series* is the tag less the name (``update_to_data``,
``state_norm/exp_avg``). Every other tag is run-wide (``global/grad_norm``, ``lr/group0``,
``health/no_grad``). This module is the one place that knows these lists: the figure selection
(``MonitorConfig.figures``), the grouping by depth over the tag budget and the report read them.
"""

from __future__ import annotations

import functools

from .families import REGISTRY

CORE = ("update_to_data", "grad_to_data", "norms", "lr", "health", "update_lost", "monitor")
"""The figure families computed from the moment table itself (:mod:`monitored_optim.figures`; ``monitor``:
the monitor's own cost, :mod:`monitored_optim.capture.spent`), all sent by default."""

FAMILIES = (*CORE, *REGISTRY)
"""Figure families ``MonitorConfig.figures`` chooses from: the core ones, then those registered in
:data:`monitored_optim.families.REGISTRY` (see :data:`PER_PARAMETER` and :data:`RUN_WIDE` for their tags)."""

DEFAULT_FAMILIES = (*CORE, *(name for name, cls in REGISTRY.items() if cls.default))
"""The families sent by default: all but ``state``, ``spectral`` and ``histograms``, which cost passes
over the optimizer state, matrix products or binning passes on every logging step (``figures="all"``
adds them)."""

PER_PARAMETER = {
    "update_to_data": "update_to_data",
    "grad_to_data": "grad_to_data",
    "update_norm": "norms",
    "grad_norm": "norms",
    "param_norm": "norms",
    "update_lost": "update_lost",
    **{head: name for name, cls in REGISTRY.items() for head in cls.series},
}
"""Head of each per-parameter tag -> its figure family: the core ones', then each registered family's
``series`` (the ``histograms`` family's tags hold the counts of fixed bins,
:mod:`monitored_optim.histograms`, not a number)."""

KEYED = frozenset(head for cls in REGISTRY.values() for head in cls.keyed)
"""Per-parameter heads followed by a key before the parameter name (the families' ``keyed``)."""

RUN_WIDE = {"global": "norms", "lr": "lr", "health": "health", "monitor": "monitor", "verify": "verify",
            "guard": "guard"}
"""Head of each run-wide tag -> its figure family (``verify`` is verify mode's, ``guard`` the guard's
(``guard/skipped``), neither selectable;
``monitor/copied_bytes`` and ``monitor/host_seconds`` are the monitor's own cost,
:mod:`monitored_optim.capture.spent`)."""

OWN_FAMILY = {tag: name for name, cls in REGISTRY.items() for tag in cls.run_wide}
"""Run-wide tags whose family is not their head's (the families' ``run_wide``)."""

assert set(PER_PARAMETER.values()) | set(RUN_WIDE.values()) | set(OWN_FAMILY.values()) <= {*FAMILIES, "verify", "guard"}


@functools.lru_cache(maxsize=1 << 16)
def family(tag: str) -> str | None:
    """The figure family of a tag without prefix (``update_norm/fc1.weight`` -> ``norms``); None
    for a tag the monitor does not write."""
    head = tag.split("/", 1)[0]
    return OWN_FAMILY.get(tag) or PER_PARAMETER.get(head) or RUN_WIDE.get(head)


@functools.lru_cache(maxsize=1 << 16)
def per_parameter(tag: str) -> tuple[str, str] | None:
    """``(series, name)`` of a per-parameter tag without prefix, else None.

    Examples: ``"update_to_data/fc1.weight"`` -> ``("update_to_data", "fc1.weight")``;
    ``"state_norm/exp_avg/h.0.w"`` -> ``("state_norm/exp_avg", "h.0.w")``; ``"global/grad_norm"`` -> None.
    """
    head, _, rest = tag.partition("/")
    if head not in PER_PARAMETER or not rest:
        return None
    if head in KEYED:
        key, _, name = rest.partition("/")
        return (f"{head}/{key}", name) if key and name else None
    return head, rest


def split(tag: str) -> tuple[str, str, str] | None:
    """``(prefix, series or head, rest)`` of a monitor tag, or None for a tag the monitor does not write.

    ``prefix`` is ``""`` or ``"{MonitorConfig.prefix}/"``; for a per-parameter tag the middle is its
    series and ``rest`` the parameter's name, for a run-wide tag its head and what follows.
    Examples: ``"update_to_data/fc1.weight"`` -> ``("", "update_to_data", "fc1.weight")``;
    ``"gen/global/grad_norm"`` -> ``("gen/", "global", "grad_norm")``.
    """
    candidates = [("", tag)]
    if "/" in tag:
        first, body = tag.split("/", 1)
        candidates.append((first + "/", body))
    for prefix, body in candidates:
        parsed = per_parameter(body)
        if parsed is not None:
            return prefix, parsed[0], parsed[1]
        head, _, rest = body.partition("/")
        if head in RUN_WIDE and rest:
            return prefix, head, rest
    return None


def is_series(kind: str) -> bool:
    """Whether ``kind`` (the middle of :func:`split`) is a per-parameter series."""
    return kind.split("/", 1)[0] in PER_PARAMETER

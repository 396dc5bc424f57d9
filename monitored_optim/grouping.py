"""Grouping by depth: one series per kind of layer, for runs with more tags than a dashboard can hold.

Parameters whose names differ only in their first numeric component, the layer index
(``transformer.h.0.attn.c_attn.weight`` ... ``transformer.h.11.attn.c_attn.weight``), form one group
keyed ``transformer.h.*.attn.c_attn.weight``. For each per-parameter figure ``{series}/{name}`` of
such a group (``{series}``: the tag less the parameter name, ``update_to_data`` or
``state_norm/exp_avg``, :func:`monitored_optim.tags.per_parameter`), :func:`summarize` gives, at one
logging step,

    {series}/{key}/min, /median, /max      the figure's minimum, median and maximum over depth
    {series}/{key}/argmin, /argmax         the layer index where the minimum and maximum are

(the median of an even count is the mean of the middle two, as ``statistics.median``). Parameters
in no group of two or more, and the figures that are not per parameter (``global/*``, ``lr/*``,
``health/*``), are passed on as they are. The histograms of a group (``update_hist/{name}``, ...)
are added bin by bin instead (their extremes the group's, their sums added), :func:`summarize_histograms`.
"""

from __future__ import annotations

import functools
import re
import statistics

from .histograms import Histogram, added
from .tags import per_parameter

STATS = ("min", "median", "max", "argmin", "argmax")
"""The suffixes of a group's summary tags, ``{series}/{key}/{stat}`` (the module docstring)."""

_INDEX = re.compile(r"(^|\.)(\d+)(\.|$)")


@functools.lru_cache(maxsize=1 << 16)
def depth_key(name: str) -> tuple[str, int] | None:
    """``(key, layer index)`` of a parameter name with a numeric component, else None.

    Example: ``depth_key("transformer.h.11.mlp.c_fc.weight") == ("transformer.h.*.mlp.c_fc.weight", 11)``;
    only the first numeric component is the depth (``layers.3.experts.7.w1`` is layer 3 of
    ``layers.*.experts.7.w1``).
    """
    match = _INDEX.search(name)
    if match is None:
        return None
    return name[:match.start(2)] + "*" + name[match.end(2):], int(match.group(2))


def summarize(figures: dict[str, float], prefix: str = "") -> dict[str, float]:
    """``figures`` with each group of per-parameter figures replaced by its depth summary.

    Args:
        figures: tag -> value of one logging step (tags as the monitor sends them, with ``prefix``).
        prefix: the monitor's tag prefix (``""`` or ``"gen/"``).

    Returns:
        A new dict: the summaries of the module docstring, and every other figure unchanged.
    """
    kept, groups = _plan(tuple(figures), prefix)
    out = {tag: figures[tag] for tag in kept}
    for base, indices, tags in groups:
        values = [figures[tag] for tag in tags]
        low, high = min(zip(values, indices)), max(zip(values, indices))
        summary = (low[0], statistics.median(values), high[0], float(low[1]), float(high[1]))
        out.update({f"{base}/{stat}": value for stat, value in zip(STATS, summary)})
    return out


def summarize_histograms(hists: dict[str, Histogram], prefix: str = "") -> dict[str, Histogram]:
    """``hists`` with each depth group's histograms replaced by their sum, bin by bin.

    The groups are :func:`summarize`'s: ``update_hist/h.0.attn.weight`` ... ``update_hist/h.11.attn.weight``
    become one ``update_hist/h.*.attn.weight`` holding, in each bin, the count over every layer (the
    fixed bins of :mod:`monitored_optim.histograms` add), the least min and greatest max of the layers
    and their sums added (:func:`~monitored_optim.histograms.added`). Histograms of parameters in no
    group pass.

    Args:
        hists: tag (with ``prefix``) -> the :class:`~monitored_optim.histograms.Histogram` of one logging step.
        prefix: the monitor's tag prefix (``""`` or ``"gen/"``).

    Returns:
        A new dict of tag -> histogram (new ones for the groups, the others as given).
    """
    kept, groups = _plan(tuple(hists), prefix)
    out = {tag: hists[tag] for tag in kept}
    for base, _, tags in groups:
        out[base] = added([hists[tag] for tag in tags])
    return out


@functools.lru_cache(maxsize=8)
def _plan(tags: tuple[str, ...], prefix: str) -> tuple[list[str], list[tuple[str, list[int], list[str]]]]:
    """The tags :func:`summarize` passes on as they are, and its groups of two or more: ``(base tag,
    layer indices, member tags)``; cached, since a run logs the same tags at every logging step."""
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for tag in tags:
        parsed = per_parameter(tag[len(prefix):]) if tag.startswith(prefix) else None
        key = depth_key(parsed[1]) if parsed is not None else None
        if parsed is not None and key is not None:
            groups.setdefault((parsed[0], key[0]), []).append((key[1], tag))
    grouped = {tag for members in groups.values() if len(members) > 1 for _, tag in members}
    return ([tag for tag in tags if tag not in grouped],
            [(f"{prefix}{series}/{key}", [i for i, _ in members], [tag for _, tag in members])
             for (series, key), members in groups.items() if len(members) > 1])

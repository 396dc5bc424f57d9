"""Per-layer figures of a run: latest value and median over the last N logged steps, and marks.

Pure functions of a :class:`~monitored_optim.report.read.Run`; no rendering here.
"""

from __future__ import annotations

import re
import statistics

from ..tags import is_series
from .errors import ReportError
from .read import Run, split_tag
from .records import GUARD, HEALTH, HEALTHY_BAND, REFERENCE as REFERENCE, Count, Figure, Layer, Param
from .table import Summary

def rows_noun(params: list[Param]) -> str:
    """What ``params`` are, for a title: ``"parameters"``, or ``"depth groups"`` where each is a group
    over depth (a run over the tag budget, its names with ``*``), ``"parameters and depth groups"``
    where some are."""
    grouped = sum("*" in p.name for p in params)
    return "parameters" if not grouped else "depth groups" if grouped == len(params) else "parameters and depth groups"


def parameters(run: Run) -> list[Param]:
    """The parameters with per-parameter tags, in layer order (first appearance in the log)."""
    found: dict[Param, None] = {}
    for tag in run.series:
        parsed = split_tag(tag)
        if parsed and is_series(parsed[1]):
            found[Param(parsed[0], parsed[2])] = None
    return list(found)


def summarize(run: Run, last: int = 20) -> Summary:
    """Latest values, medians over the last ``last`` logged steps, and marks for every parameter.

    Args:
        run: a run from :func:`~monitored_optim.report.read.load_run`.
        last: how many of the last logged steps (logging steps, not optimizer steps) the medians
            cover; an int >= 1. Fewer are used when the run logged fewer.

    Returns:
        A :class:`~monitored_optim.report.table.Summary`. Each layer's marks, judged over the window:

        - ``below band`` / ``above band``: a matrix's *median* update-to-data ratio is outside
          :data:`~monitored_optim.report.records.HEALTHY_BAND` (the -3 rule of thumb is about weight matrices);
        - ``vector``: a vector's ratio, which the band does not judge: a bias or a norm gain has a
          small spread, so its ratio reads higher than a matrix's (-2 to -1 is common); watch its
          trend (a jump, a fall to the floor) instead;
        - ``no grad``: no ``grad_norm/{name}`` was logged (the parameter never had a gradient);
        - ``unchanged``: it had a gradient but every logged ``update_norm/{name}`` is exactly 0;
        - ``no ratio``: otherwise no update-to-data ratio was logged (e.g. a one-element tensor,
          or weights with zero spread).

        The per-layer ``no grad`` / ``unchanged`` marks are what the run-wide ``health/no_grad`` and
        ``health/unchanged`` counts count, so runs with and without ``health/`` tags get them.

    Raises:
        TypeError: ``last`` is not an int.
        ValueError: ``last`` < 1.
        ReportError: no logged step holds a figure (``MonitorConfig(figures=...)`` chose none the
            report reads, or nothing was logged).
    """
    if isinstance(last, bool) or not isinstance(last, int):
        raise TypeError(f"monitored_optim: last must be an int >= 1 (the logged steps the medians cover), got {last!r}")
    if last < 1:
        raise ValueError(f"monitored_optim: last must be an int >= 1 (the logged steps the medians cover), got {last}")
    if not run.steps:
        raise ReportError(f"monitored_optim: nothing to report in {str(run.path)!r}: no logged step holds a figure "
                          "(MonitorConfig(figures=...) may have chosen none the report reads)")
    window = run.steps[-last:]
    layers = []
    for param in parameters(run):
        layer = Layer(param.label, figure(run, param.tag("update_to_data"), window),
                      figure(run, param.tag("grad_to_data"), window), figure(run, param.tag("update_norm"), window),
                      kind_of(run, param))
        layer.marks = marks(layer, _in_window(run, param.tag("grad_norm"), window),
                            _in_window(run, param.tag("update_norm"), window))
        layers.append(layer)
    kinds = {tag: parsed[1] for tag in run.series if (parsed := split_tag(tag))}
    health = {tag: _count(run, tag, window) for tag, kind in kinds.items() if kind in (HEALTH, GUARD)}
    glob = {tag: figure(run, tag, window) for tag, kind in kinds.items() if kind in ("global", "lr")}
    return Summary(run, window, layers, health, glob)


def figure(run: Run, tag: str, window: list[int]) -> Figure:
    """``Figure(latest, median)`` of ``tag``: its value at ``window[-1]`` and the median of its values
    at the steps in ``window`` (``None`` where there are none)."""
    values = _in_window(run, tag, window)
    return Figure(values[-1][1] if values and values[-1][0] == window[-1] else None,
                  statistics.median(v for _, v in values) if values else None)


def marks(layer: Layer, grad_norms: list[tuple[int, float]], update_norms: list[tuple[int, float]]) -> list[str]:
    """The warnings for ``layer`` (see :func:`summarize`), given its ``(step, value)`` grad and update
    norms in the window; ``[]`` when healthy."""
    ratio = layer.update_to_data.median
    if ratio is not None and layer.kind == "vector":
        return ["vector"]
    if ratio is not None:
        if ratio < HEALTHY_BAND[0]:
            return ["below band"]
        return ["above band"] if ratio > HEALTHY_BAND[1] else []
    if not grad_norms:
        return ["no grad"]
    if update_norms and all(v == 0 for _, v in update_norms):
        return ["unchanged"]
    return ["no ratio"]


_VECTOR_LEAVES = {"bias", "b", "gamma", "beta", "scale", "shift"}
_NORM_MODULE = re.compile(r"norm|^ln(_?\w*)?$|^bn\d*$", re.IGNORECASE)


def kind_of(run: Run, param: Param) -> str:
    """``"matrix"`` or ``"vector"``: the shape the monitor wrote to the run's ``params.json``, else
    a guess from the name (runs of older versions): biases (``*.bias``) and the parameters of
    normalization layers (``*norm*.weight``, ``ln_1.weight``, ``bn1.weight``, ``gamma``, ``beta``,
    ``scale``) count as vectors, everything else as matrices."""
    known = run.kinds.get(param.label)
    if known in ("matrix", "vector"):
        return known
    *modules, leaf = param.name.split(".")
    if leaf.lower() in _VECTOR_LEAVES or "norm" in leaf.lower() or any(_NORM_MODULE.search(m) for m in modules):
        return "vector"
    return "matrix"


def _in_window(run: Run, tag: str, window: list[int]) -> list[tuple[int, float]]:
    """The ``(step, value)`` points of ``tag`` at the steps in ``window``, in step order."""
    first = window[0] if window else 0
    return [(s, v) for s, v in run.series.get(tag, ()) if s >= first]


def _count(run: Run, tag: str, window: list[int]) -> Count:
    """``Count(latest, max over window)`` of a count tag."""
    values = _in_window(run, tag, window)
    return Count(values[-1][1] if values and values[-1][0] == window[-1] else None,
                 max(v for _, v in values) if values else None)

"""``opt.monitor.describe()``: what a monitor will measure, as a plain-text table for ``print``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import torch

from ._warnings import warn
from .capture import Capture
from .capture.plan import FlatRun
from .config import Settings
from .distributed.deepspeed import Layout
from .distributed.held import whole_shape


class Described(Protocol):
    """What :func:`describe` reads of a monitor's :class:`~monitored_optim.engine.Engine`."""

    @property
    def settings(self) -> Settings: ...

    @property
    def capture(self) -> Capture: ...

    @property
    def layout(self) -> Layout | None:
        """DeepSpeed's layout, where its wrapper steps the optimizer (None: the optimizer steps itself)."""


def describe(engine: Described, optimizer: torch.optim.Optimizer, known: dict[int, str]) -> str:
    """The param groups with their hyperparameters, then one row per parameter: name, shape,
    dtype, kind (matrix: ndim >= 2; vector), and how its update is captured and why.

    Before any logging step the capture column is the plan (a line above the table says so): the
    route the capture's plan gives a parameter at a logging step with grads of the parameters'
    dtypes (:meth:`Planned.route <monitored_optim.capture.route.Planned.route>`, named by
    :meth:`Route.label <monitored_optim.capture.route.Route.label>`): ``view (<ViewName>)``, the
    update rebuilt from the optimizer's state with the store's rounding inverted (``in N slices``
    for a large one); ``snapshot (<reason>)``, an exact copy of p_before on logging steps, for the
    reasons of :func:`~monitored_optim.capture.rules.snapshot_reason`; ``clone (<reason>)``;
    ``copied flat``, a small float32/float64 parameter copied with the other small ones of its
    chunk; ``, fused`` where the compiled fused capture takes it (``MonitorConfig(compile=...)``);
    ``skipped``, left out by ``MonitorConfig(params=...)`` or an integer tensor. Verify mode,
    sharding, closures and the ``state``/``spectral`` families keep the eager routes.

    After a logging step it is the route each parameter actually took there
    (:attr:`~monitored_optim.capture.spent.Record.routes`), with ``(next: <plan>)`` where the plan of
    the next logging step differs; a view that fell back says so: ``clone: the view fell back ...``
    (it returned a copy of p_before), ``replayed sums: ...`` (schedule-free's replay of the step,
    no copy), with ``(k of N parts)`` where only some parts did. Under the table, what each label in
    it means (:data:`LEGEND`).

    Args:
        engine: the monitor's :class:`~monitored_optim.engine.Engine`.
        optimizer: its optimizer.
        known: id -> name of the parameters of watched models.

    Returns:
        The text, lines of at most about 100 columns.
    """
    lines = [f"{type(optimizer).__name__}: {len(optimizer.param_groups)} param group(s), "
             f"logging every {engine.settings.every} step(s) to "
             f"{', '.join(engine.settings.backends) or 'no backend'}"
             + (f" and {len(engine.settings.sinks)} sink(s) of yours" if engine.settings.sinks else "")]
    for i, group in enumerate(optimizer.param_groups):
        hyper = ", ".join(f"{k}={_short(v)}" for k, v in group.items() if k not in ("params", "param_names"))
        lines.append(f"  group {i} ({len(group['params'])} parameters): {hyper}")
    last = engine.capture.spent.last
    taken = {} if last is None else last.routes
    layout = engine.layout
    if layout is not None:
        rows = _engine_rows(layout, taken)
        lines.append(f"stepped by DeepSpeed's {type(layout.wrapper()).__name__}: the model's parameters in "
                     "its flat buffers")
    else:
        rows = _rows(engine, optimizer, known, taken)
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    lines.append("capture: the plan, before any logging step (each logging step decides the route it takes)"
                 if last is None else f"capture: the route each parameter took at step {last.step}, the last "
                 "logging step ((next: ...) where the plan of the next one differs)")
    lines.append("")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    shown = [f"  {label}: {meaning}" for label, meaning in LEGEND.items()
             if any(row[4].startswith(label) or f"{label}:" in row[4] for row in rows[1:])]
    return "\n".join(lines + ([""] + shown if shown else []))


LEGEND = {
    "view": "the update rebuilt from the optimizer's state after the step, no copy",
    "copied flat": "a small tensor copied with the other small ones of its chunk before the step",
    "snapshot": "p_before copied on logging steps, where a rebuild could miss a bit (the reason in brackets)",
    "clone": "p_before copied on logging steps: no rebuild for this step",
    "replayed sums": "the step replayed for its sums, no copy",
    "skipped": "not measured",
}
"""What each capture label of :func:`describe`'s table means, in the order shown under it."""


def _rows(engine: Described, optimizer: torch.optim.Optimizer, known: dict[int, str],
          taken: dict[str, str]) -> list[tuple[str, ...]]:
    """The table of :func:`describe`, its heading first: one row per parameter of ``optimizer``, its
    capture the route ``taken`` at the last logging step, or the plan's."""
    capture = engine.capture
    plan, view = capture.preview(optimizer, known), type(capture.view).__name__
    shown: dict[int, str] = {}  # id of a parameter -> how it is captured
    for _group, items in plan.groups:
        for item in items:
            if isinstance(item, FlatRun):
                shown.update((id(e.p), item.route.label(view)) for e in item.entries)
            else:
                shown[id(item.p)] = item.route(capture.risky(item.name)).label(view)
    rows: list[tuple[str, ...]] = [HEADING]
    for group, own in zip(optimizer.param_groups, plan.names):
        for name, p in zip(own, group["params"]):
            planned = shown.get(id(p), _SKIPPED)
            took = taken.get(name, planned)
            rows.append((name, "x".join(map(str, p.shape)) or "scalar", str(p.dtype).replace("torch.", ""),
                         kind(p), took if took == planned else f"{took} (next: {planned})"))
    return rows


def _engine_rows(layout: Layout, taken: dict[str, str]) -> list[tuple[str, ...]]:
    """The table of :func:`describe` under DeepSpeed, its heading first: one row per model parameter in
    the wrapper's flat buffers (its whole shape, the dtype of the fp32 fragments the optimizer steps),
    its capture the route ``taken`` at the last logging step."""
    found: dict[str, tuple[Any, torch.Tensor, list[str]]] = {}  # name -> its parameter, a fragment, its buffers
    for k, (group, fragments) in enumerate(layout.groups()):
        for name, h in zip(group["param_names"], fragments):
            found.setdefault(name, (h.source, h.local, []))[2].append(str(k))
    rows: list[tuple[str, ...]] = [HEADING]
    for name, (source, local, buffers) in found.items():
        shape = whole_shape(source)
        where = f"in flat buffer{'s' if len(buffers) > 1 else ''} {', '.join(buffers)}"
        rows.append((name, "x".join(map(str, shape)) or "scalar", str(local.dtype).replace("torch.", ""),
                     kind(torch.Size(shape)), f"{taken[name]}, {where}" if name in taken else where))
    return rows


HEADING: tuple[str, ...] = ("parameter", "shape", "dtype", "kind", "capture")
"""The heading row of :func:`describe`'s table."""


_SKIPPED = "skipped (left out by the selection: params=, exclude= or MONITORED_OPTIM_PARAMS)"


def kind(p: torch.Tensor | torch.Size) -> str:
    """``"matrix"`` for a parameter (or a shape) of ndim >= 2 (embeddings included), else ``"vector"``
    (biases, norm gains, scalars): how the report judges its update-to-data ratio."""
    return "matrix" if len(p.shape if isinstance(p, torch.Tensor) else p) >= 2 else "vector"


def write_shapes(path: Path, prefix: str, params: list[tuple[str, torch.Size, torch.dtype]]) -> None:
    """Write ``path`` (``<logdir>/params.json``): each monitored parameter's shape, dtype and kind
    (``matrix``: ndim >= 2, embeddings included; ``vector``: biases, norm gains, scalars), for the
    report. Labels carry the tag ``prefix``; several monitors sharing the logdir merge their
    entries. A file that cannot be written is warned about (the report then guesses kinds from
    names); training goes on.

    Args:
        path: the file to write.
        prefix: the monitor's tag prefix (``""`` or ``"gen/"``).
        params: ``(name, shape, dtype)`` of each monitored parameter (its whole shape).
    """
    shapes = {prefix + name: {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
                              "kind": kind(shape)} for name, shape, dtype in params}
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**known, **shapes}, indent=1))
    except (OSError, ValueError) as err:
        warn(f"monitored_optim: cannot write {str(path)!r} ({type(err).__name__}: {err})", RuntimeWarning)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor({value.item():g})" if value.numel() == 1 else f"tensor{tuple(value.shape)}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_short(v) for v in value) + ")"
    return f"{value:g}" if isinstance(value, float) else str(value)

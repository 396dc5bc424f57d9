"""``opt.monitor.describe()``: what a monitor will measure, as a plain-text table for ``print``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from . import capture, fused
from ._warnings import warn
from .updates import CLONE, elementwise


def describe(monitor: Any, optimizer: torch.optim.Optimizer, names: list[list[str]]) -> str:
    """The param groups with their hyperparameters, then one row per parameter: name, shape,
    dtype, kind (matrix: ndim >= 2; vector), and how its update is captured and why.

    Capture is one of: ``view (<ViewName>)``, the update rebuilt from the optimizer's state with the
    store's rounding inverted (``in N slices`` for a large one); ``snapshot (<reason>)``, an exact
    copy of p_before on logging steps, for the reasons of
    :func:`~monitored_optim.capture.snapshot_reason`; ``clone``, for an optimizer without a
    state-aware view; ``copied flat``, a float32/float64 parameter of at most
    :data:`~monitored_optim.fused.SMALL` elements, copied with the other small ones of its chunk
    (``monitored_optim/fused.py``); ``, fused`` where the compiled fused capture takes it
    (``MonitorConfig(compile=...)``); ``skipped``, left out by ``MonitorConfig(params=...)`` or an
    integer tensor. These are the captures of a step with grads of the parameters' dtypes; verify
    mode, sharding, closures and the ``state``/``spectral`` families keep the eager capture.
    (A view may still take a clone of one parameter at a logging step where its hyperparameters make
    the rebuild ill-conditioned; verify mode reports any miss.)

    Args:
        monitor: the :class:`~monitored_optim.monitor.Monitor`.
        optimizer: its optimizer.
        names: each group's parameter names, as the monitor names them.

    Returns:
        The text, lines of at most about 100 columns.
    """
    lines = [f"{type(optimizer).__name__}: {len(optimizer.param_groups)} param group(s), "
             f"logging every {monitor.settings.every} step(s) to "
             f"{', '.join(monitor.settings.backends) or 'no backend'}"
             + (f" and {len(monitor.settings.sinks)} sink(s) of yours" if monitor.settings.sinks else "")]
    for i, group in enumerate(optimizer.param_groups):
        hyper = ", ".join(f"{k}={_short(v)}" for k, v in group.items() if k not in ("params", "param_names"))
        lines.append(f"  group {i} ({len(group['params'])} parameters): {hyper}")
    shared = capture.shared(p for group in optimizer.param_groups for p in group["params"])
    named = [(n, p) for group, group_names in zip(optimizer.param_groups, names) for n, p in zip(group_names, group["params"])]
    budget = capture.budget(sum(p.numel() * p.element_size() for n, p in named if monitor.settings.select(n, p)))
    rows = [("parameter", "shape", "dtype", "kind", "capture")]
    for name, p in named:
        rows.append((name, "x".join(map(str, p.shape)) or "scalar", str(p.dtype).replace("torch.", ""),
                     "matrix" if p.dim() >= 2 else "vector", _capture(monitor, name, p, shared, budget)))
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    lines.append("")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    return "\n".join(lines)


def kind(p: torch.Tensor) -> str:
    """``"matrix"`` for a parameter of ndim >= 2 (embeddings included), else ``"vector"`` (biases,
    norm gains, scalars): how the report judges its update-to-data ratio."""
    return "matrix" if p.dim() >= 2 else "vector"


def write_shapes(path: Path, prefix: str, params: list[tuple[str, torch.Tensor, torch.dtype]]) -> None:
    """Write ``path`` (``<logdir>/params.json``): each monitored parameter's shape, dtype and kind
    (``matrix``: ndim >= 2, embeddings included; ``vector``: biases, norm gains, scalars), for the
    report. Labels carry the tag ``prefix``; several monitors sharing the logdir merge their
    entries. A file that cannot be written is warned about (the report then guesses kinds from
    names); training goes on.

    Args:
        path: the file to write.
        prefix: the monitor's tag prefix (``""`` or ``"gen/"``).
        params: ``(name, parameter, dtype)`` of each monitored parameter.
    """
    shapes = {prefix + name: {"shape": list(p.shape), "dtype": str(dtype).replace("torch.", ""),
                              "kind": kind(p)} for name, p, dtype in params}
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**known, **shapes}, indent=1))
    except (OSError, ValueError) as err:
        warn(f"monitored_optim: cannot write {str(path)!r} ({type(err).__name__}: {err})", RuntimeWarning)


def _capture(monitor: Any, name: str, p: torch.Tensor, shared: set[int], budget: int) -> str:
    if not (p.is_floating_point() or p.is_complex()):
        return "skipped (integer tensor: never stepped)"
    if not monitor.settings.select(name, p):
        return "skipped (left out by the selection: params=, exclude= or MONITORED_OPTIM_PARAMS)"
    if monitor.view is CLONE:
        return "clone (no state-aware view for this optimizer's step)"
    if p.dtype in (torch.float32, torch.float64) and 0 < p.numel() <= fused.SMALL and p.layout == torch.strided:
        return f"copied flat (at most {fused.SMALL:,} elements)"
    compiled = ", fused" if fused.enabled(monitor.settings.compile, p.device) and p.dtype in (
        torch.float32, torch.float64) else ""
    reason = capture.snapshot_reason(p, id(p) in shared, name in monitor._risk)
    if reason is not None:
        return f"snapshot ({reason}){compiled}"
    if compiled and getattr(monitor.view, "fused", None) is not None:
        return f"view ({type(monitor.view).__name__}){compiled}"
    limit = budget // p.element_size()
    slices = -(-p.numel() // limit) if elementwise(monitor.view) and p.numel() > limit else 1
    return f"view ({type(monitor.view).__name__})" + (f", in {slices} slices" if slices > 1 else "")


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor({value.item():g})" if value.numel() == 1 else f"tensor{tuple(value.shape)}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_short(v) for v in value) + ")"
    return f"{value:g}" if isinstance(value, float) else str(value)

"""The report table, rendered with ``rich``: one row per parameter in layer order."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

from .errors import require
from .summary import HEALTHY_BAND, REFERENCE, Count, Figure, Summary, split_tag

if TYPE_CHECKING:  # rich is an optional dependency, imported when rendering
    from rich.console import RenderableType


def render(summary: Summary) -> list[RenderableType]:
    """The report as ``rich`` renderables: the per-parameter table, a note on the window, the latest
    global figures, and the run-wide ``health/`` counts (when the run logged them; non-zero in red).

    Table columns: ``#`` (layer order), ``parameter``, update-to-data latest / median (log10 ratio),
    grad-to-data latest / median (log10 ratio), update norm latest / median (L2, parameter units),
    ``mark``. Medians cover ``summary.window``. Ratios outside the healthy band are shown in red.

    Raises:
        ReportError: ``rich`` is not installed.
    """
    require("rich", "rich")
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    run, window = summary.run, summary.window
    span = f"steps {window[0]}-{window[-1]}" if len(window) > 1 else f"step {window[0]}"
    table = Table(
        title=f"{escape(str(run.path))}  ({run.source}, {len(run.steps)} logged steps, last step {run.steps[-1]})",
        box=box.SIMPLE_HEAD, title_justify="left", header_style="bold")
    table.add_column("#", justify="right", style="dim")
    table.add_column("parameter", no_wrap=True)
    for head in ("update/data\nlatest", "update/data\nmedian", "grad/data\nlatest", "grad/data\nmedian",
                 "update norm\nlatest", "update norm\nmedian"):
        table.add_column(head, justify="right", no_wrap=True)
    table.add_column("mark", style="bold red")
    for i, layer in enumerate(summary.layers):
        table.add_row(str(i), escape(layer.name), *_ratio_cells(layer.update_to_data, band=True),
                      *_ratio_cells(layer.grad_to_data, band=False),
                      _norm(layer.update_norm.latest), _norm(layer.update_norm.median), escape(", ".join(layer.marks)))
    out: list[RenderableType] = [table, (
        f"[dim]medians over the last {len(window)} logged steps ({span}); healthy update-to-data band "
        f"[{HEALTHY_BAND[0]:g}, {HEALTHY_BAND[1]:g}], rule of thumb {REFERENCE:g}; the mark judges the median[/dim]")]
    glob = "  ".join(f"{escape(tag)} {_norm(f.latest)}" for tag, f in summary.globals.items())
    if glob:
        out.append(f"[dim]latest:[/dim] {glob}")
    if summary.health:
        counts = "  ".join(_health(_health_label(tag), count) for tag, count in summary.health.items())
        out.append(f"[dim]health, latest (max over the window):[/dim] {counts}")
    return out


def print_report(summary: Summary, file: TextIO | None = None) -> None:
    """Print :func:`render` to ``file`` (default stdout).

    On a terminal the terminal's width is used; otherwise (a pipe or file) the width the table
    needs, so rows never wrap.

    Raises:
        ReportError: ``rich`` is not installed.
    """
    parts = render(summary)
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(file=file, highlight=False)
    if not console.is_terminal:
        width = max(Measurement.get(console, console.options.update(width=10_000), parts[0]).maximum, 80)
        console = Console(file=file, width=width, highlight=False)
    for part in parts:
        console.print(part, soft_wrap=isinstance(part, str))  # note lines never wrap mid-sentence


def _ratio_cells(f: Figure, band: bool) -> tuple[str, str]:
    return _ratio(f.latest, band), _ratio(f.median, band)


def _ratio(value: float | None, band: bool) -> str:
    if value is None:
        return "[dim]-[/dim]"
    text = f"{value:.2f}"
    if band and not HEALTHY_BAND[0] <= value <= HEALTHY_BAND[1]:
        return f"[red]{text}[/red]"
    return text


def _norm(value: float | None) -> str:
    return "[dim]-[/dim]" if value is None else f"{value:.3g}"


def _health_label(tag: str) -> str:
    """``health/no_grad`` -> ``no_grad``; ``gen/health/no_grad`` -> ``gen/no_grad``."""
    prefix, _, rest = split_tag(tag) or ("", "", tag)
    return prefix + rest


def _health(kind: str, count: Count) -> str:
    from rich.markup import escape

    text = f"{escape(kind)} {_count(count.latest)} ({_count(count.worst)})"
    return f"[bold red]{text}[/bold red]" if count.worst else text


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"

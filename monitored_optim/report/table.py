"""The report table, rendered with ``rich``: one row per parameter in layer order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from ..grouping import depth_key
from .errors import ReportError, require
from .read import Run, split_tag
from .records import HEALTHY_BAND, REFERENCE, Count, Figure, Layer

if TYPE_CHECKING:  # rich is an optional dependency, imported when rendering
    from rich.console import RenderableType
    from rich.table import Table
    from rich.text import Text


WIDTH = 80
"""Columns the report is laid out for when the output is not a terminal (a pipe, a file)."""


@dataclass
class Summary:
    """What the report table shows.

    Attributes:
        run: the run summarized.
        window: the logged steps the medians cover (the last ``last`` of ``run.steps``).
        layers: one :class:`~monitored_optim.report.records.Layer` per parameter in layer order.
        health: the run-wide ``[prefix/]health/`` counts (``health/no_grad``, ``health/unchanged``,
            ``health/nonfinite``, ``health/skipped_steps``: numbers of parameters, or of skipped
            steps; and ``guard/skipped``) -> :class:`~monitored_optim.report.records.Count`; empty
            when the run logged none (runs of older versions).
        globals: ``[prefix/]global/...`` and ``[prefix/]lr/...`` tags ->
            :class:`~monitored_optim.report.records.Figure`.
    """

    run: Run
    window: list[int]
    layers: list[Layer]
    health: dict[str, Count]
    globals: dict[str, Figure]

    def __repr__(self) -> str:
        """The report table as plain text, 80 columns (:func:`~monitored_optim.report.table.to_text`),
        or, without ``rich``, the line that says how to install it."""
        try:
            return to_text(self)
        except ReportError as err:
            return f"<Summary of {len(self.layers)} parameters: {err}>"

    def _repr_html_(self) -> str:
        """The report table as HTML, what Jupyter shows for a summary."""
        return to_text(self, html=True)


def render(summary: Summary, width: int = WIDTH) -> list[RenderableType]:
    """The report as ``rich`` renderables: a title line (the run, its source and logged steps), a line
    naming the later runs kept apart in its directory (if any), the per-parameter table, a note on the
    window, the latest global figures, and the run-wide ``health/`` counts (when the run logged them;
    non-zero in red), their tags shortened in the middle to fit ``width`` as names are.

    Table columns: ``#`` (layer order), ``parameter`` (shortened in the middle to fit ``width``,
    keeping the layer index and the end: ``tran…11.attn.c_attn.weight``), ``u/d`` median and latest
    (update-to-data, log10 ratio), ``g/d`` median (grad-to-data, log10 ratio), ``|u|`` median (update
    norm, L2, parameter units), and ``verdict`` (see :func:`~monitored_optim.report.summary.summarize`). Medians cover
    ``summary.window``. Matrices' ratios outside the healthy band are shown in red.

    Args:
        summary: from :func:`~monitored_optim.report.summary.summarize`.
        width: the columns to fit (the table keeps every column down to about 60).

    Raises:
        ReportError: ``rich`` is not installed.
    """
    require("rich", "rich")
    from rich.markup import escape

    window = summary.window
    span = f"steps {window[0]}-{window[-1]}" if len(window) > 1 else f"step {window[0]}"
    room = min(max(len(layer.name) for layer in summary.layers), width) if summary.layers else 9
    table = _table(summary, room)
    while (excess := _width(table) - width) > 0 and room > 12:  # names give way, nothing else
        room = max(12, room - excess)
        table = _table(summary, room)
    out: list[RenderableType] = [_title(summary, width), *_later(summary.run), table, (
        "[dim]u/d: update-to-data ratio, log10(std(update) / std(weights)); g/d: the same for the grad; "
        f"|u|: update norm. Medians over the last {len(window)} logged steps ({span}). The verdict judges a matrix's "
        f"median: healthy band [{HEALTHY_BAND[0]:g}, {HEALTHY_BAND[1]:g}], rule of thumb {REFERENCE:g}. "
        "Vectors (biases, norm gains) are not judged by the band: their small spread makes their "
        "ratio read higher; watch their trend.[/dim]")]
    tag_room = max(width - 12, 12)  # a tag and its value on one line
    latest = [(shorten(tag, tag_room), f.latest) for tag, f in summary.globals.items()]
    glob = [(f"{tag} {_plain(value)}", f"{escape(tag)} {_norm(value)}") for tag, value in latest]
    if glob:
        out.append(_pack("latest:", glob, width))
    if summary.health:
        counts = [_health(shorten(_health_label(tag), tag_room), count) for tag, count in summary.health.items()]
        out.append(_pack("health, latest (max over the window):", counts, width))
    return out


def _title(summary: Summary, width: int) -> Text:
    """One line: the run's path (its start cut to fit ``width``, the run's own name kept), its source
    and logged steps."""
    from rich.text import Text

    run = summary.run
    about = f"  ({run.source}, {len(run.steps)} logged steps, last step {run.steps[-1]})"
    path, room = str(run.path), max(width - len(about), 12)
    text = Text(path if len(path) <= room else "…" + path[len(path) - room + 1:])
    text.append(about)
    text.no_wrap = True
    return text


def _later(run: Run) -> list[str]:
    """The line that names the later runs kept apart in ``run``'s directory, if it holds any."""
    from rich.markup import escape

    if not run.later:
        return []
    names = ", ".join(path.name for path in run.later)
    return [f"[yellow]also here, later runs kept apart: {escape(names)}; report one by its path: "
            f"{escape(str(run.later[-1]))}[/yellow]"]


def _pack(title: str, items: list[tuple[str, str]], width: int) -> Text:
    """``title`` and the ``(plain, markup)`` items on as few lines of ``width`` as fit, breaking
    between items only (a rich ``Text`` that is printed without further wrapping)."""
    from rich.text import Text

    lines, line, size = [], [f"[dim]{title}[/dim]"], len(title)
    for plain, markup in items:
        if size + 2 + len(plain) > width and len(line) > 1:
            lines.append(" ".join(line))
            line, size = ["  "], 2
        line.append(markup)
        size += 2 + len(plain)
    lines.append(" ".join(line))
    text = Text.from_markup("\n".join(lines))
    text.no_wrap = True
    return text


def _table(summary: Summary, room: int) -> Table:
    """The per-parameter table with names shortened to ``room`` characters."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, collapse_padding=True)
    table.add_column("#", justify="right", style="dim", no_wrap=True)
    table.add_column("parameter", no_wrap=True)
    for head in ("u/d\nmedian", "u/d\nlatest", "g/d\nmedian", "|u|\nmedian"):
        table.add_column(head, justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for i, layer in enumerate(summary.layers):
        matrix = layer.kind == "matrix"
        verdict = ", ".join(layer.marks)
        table.add_row(str(i), escape(shorten(layer.name, room)), _ratio(layer.update_to_data.median, matrix),
                      _ratio(layer.update_to_data.latest, matrix), _ratio(layer.grad_to_data.median, False),
                      _norm(layer.update_norm.median),
                      f"[dim]{verdict}[/dim]" if verdict == "vector" else f"[bold red]{escape(verdict)}[/bold red]")
    return table


def _width(table: Table) -> int:
    """The columns ``table`` takes unshrunk."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000)
    return Measurement.get(console, console.options, table).maximum


def shorten(name: str, width: int) -> str:
    """``name`` cut to ``width`` characters with "…" in the middle, keeping its end and, where it has
    one, its layer index: ``shorten("transformer.h.11.attn.c_attn.weight", 26)`` is
    ``"tran…11.attn.c_attn.weight"``."""
    if len(name) <= width:
        return name
    key = depth_key(name)
    if key is not None:
        index = str(key[1])
        at = key[0].index("*")
        tail = name[at:]  # from the layer index on
        head = width - len(tail) - 1
        if head >= 0:
            return name[:head] + "…" + tail
        keep = width - len(index) - 2
        if keep > 0:
            return index + "…" + name[-keep:] if at == 0 else "…" + index + "…" + name[-(keep - 1):]
    return "…" + name[-(width - 1):]


def print_report(summary: Summary, file: TextIO | None = None) -> None:
    """Print :func:`render` to ``file`` (default stdout), fitted to the terminal's width, or to
    :data:`WIDTH` columns when the output is not a terminal (a pipe, a file).

    Raises:
        ReportError: ``rich`` is not installed.
    """
    require("rich", "rich")
    from rich.console import Console

    console = Console(file=file, highlight=False)
    if not console.is_terminal:  # plain text, no line ending in spaces
        console.file.write(to_text(summary))
        return
    for part in render(summary, console.width):
        console.print(part)  # notes wrap between items only: each item's spaces are non-breaking


def to_text(summary: Summary, width: int = WIDTH, html: bool = False) -> str:
    """:func:`render` laid out in ``width`` columns, as plain text (no line ending in spaces), or as an
    HTML ``<pre>`` block with the colours inline (what Jupyter shows for a :class:`Summary`).

    Raises:
        ReportError: ``rich`` is not installed.
    """
    require("rich", "rich")
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, record=True, highlight=False, force_jupyter=False,
                      color_system="truecolor" if html else None)
    for part in render(summary, width):
        console.print(part)
    if not html:
        return "\n".join(line.rstrip() for line in console.export_text().split("\n"))
    return console.export_html(inline_styles=True, code_format=(
        "<pre style=\"white-space:pre;overflow-x:auto;line-height:normal;"
        "font-family:Menlo,'DejaVu Sans Mono',consolas,'Courier New',monospace\">{code}</pre>"))


def _ratio(value: float | None, band: bool) -> str:
    """Two decimals, three where two would round onto a band edge (-1.999 is above the band)."""
    if value is None:
        return "[dim]-[/dim]"
    near_edge = any(abs(value - edge) < 0.005 and value != edge for edge in HEALTHY_BAND)
    text = f"{value:.3f}" if near_edge else f"{value:.2f}"
    if band and not HEALTHY_BAND[0] <= value <= HEALTHY_BAND[1]:
        return f"[red]{text}[/red]"
    return text


def _plain(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _norm(value: float | None) -> str:
    return "[dim]-[/dim]" if value is None else _plain(value)


def _health_label(tag: str) -> str:
    """``health/no_grad`` -> ``no_grad``; ``gen/health/no_grad`` -> ``gen/no_grad``; ``guard/skipped``
    keeps its head."""
    prefix, head, rest = split_tag(tag) or ("", "health", tag)
    return prefix + (rest if head == "health" else f"{head}/{rest}")


def _health(kind: str, count: Count) -> tuple[str, str]:
    """``(plain, markup)`` of one count: ``nonfinite 0 (1)``, in red when the window saw any."""
    from rich.markup import escape

    plain = f"{kind} {_count(count.latest)} ({_count(count.worst)})"
    return plain, f"[bold red]{escape(plain)}[/bold red]" if count.worst else escape(plain)


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"

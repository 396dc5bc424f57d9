"""The report's pictures: the update-to-data lines of a few parameters with the global norms, and a
heatmap of every parameter's update-to-data ratio over the logged steps.

Drawn with matplotlib's object API on an Agg canvas (no ``pyplot``, no global backend switch), so it
works headless and inside a process that uses another matplotlib backend.
"""

from __future__ import annotations

import fnmatch
import functools
import io
import math
import statistics
from collections.abc import Callable
from pathlib import Path

from ..grouping import depth_key
from .errors import ReportError, quote, reason, require
from .read import Run
from .records import HEALTHY_BAND, REFERENCE, Param
from .summary import kind_of, parameters, rows_noun
from .table import shorten

LINES = 10
"""Parameters the line plot draws by default: the matrices with the highest and the lowest median
update-to-data ratio (half each), so that every curve has its own colour and legend entry."""
LABEL = 60
"""Characters of a parameter's label in a legend or beside a heatmap row at most (shortened in the
middle as in the table)."""


def _drawing(plot: Callable[..., Path]) -> Callable[..., Path]:
    """``plot(run, path, ...)`` raising one :class:`ReportError` naming ``path`` for what matplotlib
    refuses (figures whose span overflows float64, a suffix it has no format for), without numpy's
    float warnings from inside matplotlib on such figures."""

    @functools.wraps(plot)
    def guarded(run: Run, path: str | Path, **options) -> Path:
        np = require("numpy", "matplotlib")  # installed with matplotlib
        try:
            with np.errstate(all="ignore"):
                return plot(run, path, **options)
        except (ValueError, OverflowError) as exc:
            raise ReportError(f"{path}: cannot draw the plot ({reason(exc)})") from None

    return guarded


@_drawing
def plot_run(run: Run, path: str | Path, *, params: str | None = None, dpi: int = 110) -> Path:
    """Draw :func:`draw_run`'s figure of ``run`` and save it at ``path`` (format from the suffix,
    e.g. ``.png``, which a path without one gets; its directory must exist) at ``dpi``.

    Returns:
        The path written, as a :class:`~pathlib.Path`.

    Raises:
        ReportError: as :func:`draw_run`, or the file cannot be written.
    """
    return _save(draw_run(run, params=params), path, dpi)


def draw_run(run: Run, *, params: str | None = None):
    """The update-to-data ratio of a few parameters and the global norms, as a matplotlib ``Figure``.

    Top panel: ``[prefix/]update_to_data/{name}`` (log10 of std(update) / std(weights)) against the
    optimizer step for the chosen parameters, each in its own colour: matrices (ndim >= 2) as
    thick solid lines, vectors (biases, norm gains) thin and dashed, by the shapes in the run's
    ``params.json`` (else guessed from the names, :func:`~monitored_optim.report.summary.kind_of`);
    the healthy band [-4, -2] shaded and the -3 reference dashed; the legend below the axes.
    Bottom panel: ``global/grad_norm`` and ``global/update_norm`` (L2 norms over all monitored
    parameters; one pair per tag prefix) on a log scale; non-positive values are left out.

    Args:
        run: a run from :func:`~monitored_optim.report.read.load_run`.
        params: a glob on parameter labels (``"transformer.h.3.*"``; ``fnmatch`` rules) choosing the
            parameters drawn; default: the :data:`LINES` matrices with the highest and lowest median
            ratio over the run (every parameter when there are no more than :data:`LINES`).

    Returns:
        A ``matplotlib.figure.Figure`` on an Agg canvas (Jupyter shows it inline).

    Raises:
        ReportError: matplotlib is not installed, ``params`` matches no parameter with a ratio, the
            figures cannot be drawn (a span beyond float64) or the file cannot be written.
    """
    require("matplotlib", "matplotlib")
    chosen = _chosen(run, params)
    fig = _figure(figsize=(10.0, 7.0 + 0.18 * math.ceil(len(chosen) / 3)))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.2])
    _draw_ratios(top, run, chosen)
    _draw_norms(bottom, run)
    bottom.set_xlabel("optimizer step")
    drawable = _with_ratio(run)
    fig.suptitle(f"{run.path.resolve().name}: update-to-data ratio ({run.source}; {len(chosen)} of "
                 f"{len(drawable)} {rows_noun(drawable)})", fontsize=11)
    return fig


@_drawing
def plot_heatmap(run: Run, path: str | Path, *, dpi: int = 110) -> Path:
    """Draw every parameter's update-to-data ratio as a heatmap and save it at ``path``.

    Rows: the parameters, matrices first, then vectors (two panels), each ordered by kind of layer
    and then by depth (``h.0.attn.c_attn.weight`` ... ``h.11.attn.c_attn.weight`` together, in layer
    order; :func:`~monitored_optim.grouping.depth_key`). Columns: the logged steps. Colour: the
    log10 ratio on a diverging scale centred on -3 (blue below, red above; white at -3, the band's
    edges -4 and -2 marked on the colour bar); grey where nothing was logged. Up to 60 rows carry
    their names; more carry the name of each kind of layer at its first row.

    Args:
        run: a run from :func:`~monitored_optim.report.read.load_run`.
        path: the image file to write.
        dpi: resolution of the saved image.

    Returns:
        The path written (``.png`` added where ``path`` has no suffix), as a :class:`~pathlib.Path`.

    Raises:
        ReportError: matplotlib or numpy is missing, the run has no ratios, the ratios cannot be
            drawn (a span beyond float64) or the file cannot be written.
    """
    require("matplotlib", "matplotlib")
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    params = _with_ratio(run)
    if not params:
        raise ReportError(f"{run.path}: no update-to-data ratios to draw")
    panels = [(kind, _by_depth([p for p in params if kind_of(run, p) == kind])) for kind in ("matrix", "vector")]
    panels = [(kind, rows) for kind, rows in panels if rows]
    order = [p for _, rows in panels for p in rows]
    values = _ratios(run, order)
    finite = values[np.isfinite(values)]
    vmin, vmax = min(finite.min(), REFERENCE - 2.0), max(finite.max(), REFERENCE + 2.0)
    norm = TwoSlopeNorm(vcenter=REFERENCE, vmin=vmin, vmax=vmax)
    heights = [max(len(rows), 3) for _, rows in panels]
    fig = _figure(figsize=(10.0, min(4.0 + 0.14 * min(len(order), 60) + 0.004 * len(order), 16.0)))
    axes = fig.subplots(len(panels), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    start = 0
    for ax, (kind, rows) in zip(axes, panels):
        block = np.ma.masked_invalid(values[start:start + len(rows)])
        start += len(rows)
        image = ax.imshow(block, aspect="auto", interpolation="nearest", cmap=_cmap(), norm=norm,
                          extent=(-0.5, len(run.steps) - 0.5, len(rows) - 0.5, -0.5))
        _label_rows(ax, rows)
        ax.set_ylabel(("matrices" if kind == "matrix" else "vectors (the band is for matrices)") + f": {len(rows)}",
                      fontsize=8)
    _label_steps(axes[-1], run.steps)
    bar = fig.colorbar(image, ax=list(axes), shrink=0.8, pad=0.01)
    ticks = sorted(t for t in {vmin, HEALTHY_BAND[0], REFERENCE, HEALTHY_BAND[1], vmax}
                   if vmin <= t <= vmax)  # a tick outside the range blanks a TwoSlopeNorm bar
    bar.set_ticks(ticks, labels=[f"{t:.3g}" for t in ticks])
    bar.set_label("log10(std(update) / std(weights))", fontsize=8)
    fig.suptitle(f"{run.path.resolve().name}: update-to-data ratio, {len(order)} {rows_noun(order)} × "
                 f"{len(run.steps)} logged steps ({run.source})", fontsize=11)
    return _save(fig, path, dpi)


def _ratios(run: Run, params: list[Param]):
    """The update-to-data ratios of ``params`` (rows) at the run's logged steps (columns), a float64
    numpy array, NaN where a parameter logged none."""
    import numpy as np

    column = {step: i for i, step in enumerate(run.steps)}
    values = np.full((len(params), len(run.steps)), np.nan)
    for i, p in enumerate(params):
        for step, v in run.series[p.tag("update_to_data")]:
            values[i, column[step]] = v
    return values


def _figure(figsize: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    # Jupyter shows it inline, pyplot imported or not (an attribute of this figure only)
    fig._repr_png_ = functools.partial(_png, fig)  # type: ignore[attr-defined]
    return fig


def _png(fig, dpi: int = 110) -> bytes:
    """``fig`` as PNG bytes, as :func:`plot_run` saves it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def _save(fig, path: str | Path, dpi: int) -> Path:
    """Save ``fig`` at ``path`` (``.png`` added where it has no suffix, as matplotlib would); the path
    written. Raises :class:`ReportError` for an empty path, a directory, or a file that cannot be
    written (a missing directory, a name too long, no permission, a format whose tools are missing)."""
    if not str(path):
        raise ReportError("the image's path is empty; give a file name, as plot.png")
    given = Path(path)
    try:
        directory = given.is_dir()
    except OSError:  # a name too long, a directory not searchable: savefig below says which
        directory = False
    if directory:
        raise ReportError(f"{given}: is a directory; give the image's file name, as {given / 'plot.png'}")
    written = given if given.suffix else given.with_name(f"{given.name}.png")
    try:
        fig.savefig(written, dpi=dpi, bbox_inches="tight")
    except (OSError, RuntimeError) as exc:  # RuntimeError: a format's missing tool (.pgf without LaTeX)
        raise ReportError(f"{written}: cannot write the plot ({reason(exc)})") from None
    return written


def _cmap():
    from matplotlib import colormaps

    return colormaps["RdBu_r"].with_extremes(bad="0.85")


def _with_ratio(run: Run) -> list[Param]:
    return [p for p in parameters(run) if run.series.get(p.tag("update_to_data"))]


def _chosen(run: Run, pattern: str | None) -> list[Param]:
    """The parameters :func:`draw_run` draws (see its ``params``)."""
    params = _with_ratio(run)
    if pattern is not None:
        picked = [p for p in params if fnmatch.fnmatchcase(p.label, pattern)]
        if not picked:
            raise ReportError(f"{run.path}: --params {quote(pattern)} matches no parameter with an update-to-data "
                              f"ratio (labels look like {quote(params[0].label)})" if params else
                              f"{run.path}: no update-to-data ratios to draw")
        return picked
    if len(params) <= LINES:
        return params
    matrices = [p for p in params if kind_of(run, p) == "matrix"] or params
    ranked = sorted(matrices, key=lambda p: statistics.median(v for _, v in run.series[p.tag("update_to_data")]))
    keep = set(ranked[:LINES // 2] + ranked[-(LINES - LINES // 2):])
    return [p for p in params if p in keep]


def _by_depth(params: list[Param]) -> list[Param]:
    """Parameters grouped by kind of layer (first appearance), each group in layer order."""
    keys = {p: depth_key(p.label) or (p.label, -1) for p in params}
    first: dict[str, int] = {}
    for p in params:
        first.setdefault(keys[p][0], len(first))
    return sorted(params, key=lambda p: (first[keys[p][0]], keys[p][1]))


def _label_rows(ax, rows: list[Param]) -> None:
    """Each row's label when they fit, else each kind of layer's label at its first row."""
    if len(rows) <= 60:
        labels = [shorten(p.label, LABEL) for p in rows]
        ax.set_yticks(range(len(rows)), labels, fontsize=max(5.0, 8.0 - len(rows) / 15))
        return
    ticks: list[int] = []
    labels = []
    seen: set[str] = set()
    gap = len(rows) / 40  # at most about 40 labels a panel
    for i, p in enumerate(rows):
        key = (depth_key(p.label) or (p.label, -1))[0]
        if key not in seen:
            seen.add(key)
            ax.axhline(i - 0.5, color="white", lw=0.4)
            if not ticks or i - ticks[-1] >= gap:  # a label only where it does not overlap the last
                ticks.append(i)
                labels.append(shorten(key, LABEL))
    ax.set_yticks(ticks, labels, fontsize=6)


def _label_steps(ax, steps: list[int]) -> None:
    stride = max(1, math.ceil(len(steps) / 12))
    ax.set_xticks(range(0, len(steps), stride), [str(s) for s in steps[::stride]], fontsize=7)
    ax.set_xlabel("optimizer step (one column per logged step)")


def _draw_ratios(ax, run: Run, params: list[Param]) -> None:
    """Top panel: one line per chosen parameter, the band and the reference, the legend below."""
    from matplotlib import colormaps

    palette = colormaps["tab10" if len(params) <= 10 else "tab20"]
    band = ax.axhspan(*HEALTHY_BAND, color="tab:green", alpha=0.10, lw=0, zorder=0)
    ref = ax.axhline(REFERENCE, color="black", ls="--", lw=1.0, alpha=0.7, zorder=1)
    every_value = [HEALTHY_BAND[0], HEALTHY_BAND[1]]
    for i, p in enumerate(params):
        steps, values = zip(*run.series[p.tag("update_to_data")])
        every_value += values
        marker = "o" if len(steps) == 1 else None  # a single point draws no line
        matrix = kind_of(run, p) == "matrix"
        label = shorten(p.label, LABEL) + ("" if matrix else " (vector)")
        ax.plot(steps, values, color=palette(i % palette.N), ls="-" if matrix else "--", lw=1.8 if matrix else 1.0,
                alpha=0.95, marker=marker, label=label, zorder=3 if matrix else 2)
    ax.set_ylabel("log10(std(update) / std(weights))")
    ax.grid(True, alpha=0.25)
    ax.set_ylim(min(every_value) - 0.25, max(every_value) + 0.25)
    labels = [f"healthy band for matrices [{HEALTHY_BAND[0]:g}, {HEALTHY_BAND[1]:g}]", f"rule of thumb {REFERENCE:g}"]
    ax.add_artist(ax.legend([band, ref], labels, loc="lower right", fontsize=7, framealpha=0.8))
    if params:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.04), ncols=3, fontsize=7, frameon=False,
                  handlelength=2.2, columnspacing=1.5)
    else:
        ax.text(0.5, 0.5, "no update-to-data ratios in this run", transform=ax.transAxes, ha="center")


def _draw_norms(ax, run: Run) -> None:
    """Bottom panel: global grad and update norms against step, log scale."""
    drawn: list[float] = []
    prefixes = list(dict.fromkeys(p.prefix for p in parameters(run))) or [""]
    for i, prefix in enumerate(prefixes):
        for what, colour in (("grad", "tab:red"), ("update", "tab:blue")):
            points = [(s, v) for s, v in run.series.get(f"{prefix}global/{what}_norm", ()) if v > 0]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, color=colour, ls=["-", "--", ":", "-."][i % 4], lw=1.2,
                        label=f"{prefix}{what} norm")
                drawn += values
    if drawn:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        few_decades = math.log10(max(drawn) / min(drawn)) < 3  # label 2x and 5x ticks only when they fit
        ax.yaxis.set_minor_formatter(plain if few_decades else NullFormatter())
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False, borderaxespad=0.0)
    else:
        ax.text(0.5, 0.5, "no global norms in this run", transform=ax.transAxes, ha="center")
    ax.set_ylabel("global L2 norm")
    ax.grid(True, which="both", alpha=0.25)

"""The report plot: update-to-data ratio against step per parameter, and the global norms.

Drawn with matplotlib's object API on an Agg canvas (no ``pyplot``, no global backend switch), so it
works headless and inside a process that uses another matplotlib backend.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

from .errors import ReportError, require
from .read import Run
from .summary import HEALTHY_BAND, REFERENCE, Param, parameters

_VECTOR_LEAVES = {"bias", "b", "gamma", "beta", "scale", "shift"}
_NORM_MODULE = re.compile(r"norm|^ln(_?\w*)?$|^bn\d*$", re.IGNORECASE)
LEGEND_ROWS = 26
"""Legend entries per column; more parameters add columns to the right of the axes."""


def looks_like_matrix(name: str) -> bool:
    """Guess from a parameter's name whether it is a weight matrix (2-D or more) or a vector.

    The logs hold no shapes, so the plot goes by name: biases (``*.bias``) and the parameters of
    normalization layers (``*norm*.weight``, ``ln_1.weight``, ``bn1.weight``, ``gamma``, ``beta``,
    ``scale``) count as vectors; everything else as a matrix. Pass ``matrix=`` to :func:`plot_run`
    to decide exactly.

    Returns:
        ``True`` for a presumed matrix, ``False`` for a presumed vector.
    """
    *modules, leaf = name.split(".")
    if leaf.lower() in _VECTOR_LEAVES or "norm" in leaf.lower():
        return False
    return not any(_NORM_MODULE.search(m) for m in modules)


def plot_run(run: Run, path: str | Path, *, matrix: Callable[[str], bool] | None = None,
             dpi: int = 110) -> Path:
    """Draw the run and save it as an image at ``path`` (format from the suffix, e.g. ``.png``).

    Top panel: ``[prefix/]update_to_data/{name}`` (log10 of std(update) / std(weights)) against
    optimizer step for every parameter, in layer order; weight matrices as thick solid lines,
    vectors (biases, norms) thin and faded in their layer's colour; the healthy band [-4, -2]
    shaded and the -3 reference dashed. The legend sits outside the axes, in small type, one column per
    :data:`LEGEND_ROWS` parameters. Bottom panel: ``global/grad_norm`` and ``global/update_norm``
    (L2 norms over all monitored parameters; one pair per tag prefix) on a log scale; non-positive
    values are left out.

    Args:
        run: a run from :func:`~monitored_optim.report.read.load_run`.
        path: the image file to write; its directory must exist.
        matrix: ``name -> bool`` (the name without tag prefix), whether a parameter is a weight
            matrix, drawn prominently; default :func:`looks_like_matrix`.
        dpi: resolution of the saved image.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ReportError: matplotlib is not installed, or the file cannot be written.
    """
    require("matplotlib", "matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    matrix = matrix or looks_like_matrix
    path = Path(path)
    params = [p for p in parameters(run) if p.tag("update_to_data") in run.series]
    columns = max(1, math.ceil(len(params) / LEGEND_ROWS))
    fig = Figure(figsize=(8.5 + 2.3 * columns, 7.0), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.2])
    _draw_ratios(top, run, params, matrix, columns)
    _draw_norms(bottom, run)
    bottom.set_xlabel("optimizer step")
    fig.suptitle(f"{run.path.resolve().name}: update-to-data ratio per parameter ({run.source})",
                 fontsize=11)
    try:
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path}: cannot write the plot ({type(exc).__name__}: {exc})") from None
    return path


def _layer_styles(labels: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Colour per parameter label (shared by the parameters of one module) and a line style per
    module (solid for the first ten modules, then dashed, dotted, dash-dot as the colours repeat)."""
    styles = ["-", "--", ":", "-."]
    module = {label: label.rsplit(".", 1)[0] for label in labels}
    index = {m: i for i, m in enumerate(dict.fromkeys(module.values()))}
    return ({label: f"C{index[m] % 10}" for label, m in module.items()},
            {label: styles[(index[m] // 10) % 4] for label, m in module.items()})


def _draw_ratios(ax, run: Run, params: list[Param], matrix: Callable[[str], bool], columns: int) -> None:
    """Top panel: one line per parameter, the band and the reference, the legend outside."""
    colour, style = _layer_styles([p.label for p in params])
    band = ax.axhspan(*HEALTHY_BAND, color="tab:green", alpha=0.10, lw=0, zorder=0)
    ref = ax.axhline(REFERENCE, color="black", ls="--", lw=1.0, alpha=0.7, zorder=1)
    every_value = [HEALTHY_BAND[0], HEALTHY_BAND[1]]
    for p in params:
        steps, values = zip(*run.series[p.tag("update_to_data")])
        every_value += values
        marker = "o" if len(steps) == 1 else None  # a single point draws no line
        if matrix(p.name):
            ax.plot(steps, values, color=colour[p.label], ls=style[p.label], lw=1.8, alpha=0.95,
                    marker=marker, label=p.label, zorder=3)
        else:
            ax.plot(steps, values, color=colour[p.label], ls="-", lw=0.8, alpha=0.45, marker=marker,
                    label=p.label, zorder=2)
    ax.set_ylabel("log10(std(update) / std(weights))")
    ax.grid(True, alpha=0.25)
    ax.set_ylim(min(every_value) - 0.25, max(every_value) + 0.25)
    labels = [f"healthy band [{HEALTHY_BAND[0]:g}, {HEALTHY_BAND[1]:g}]", f"rule of thumb {REFERENCE:g}"]
    ax.add_artist(ax.legend([band, ref], labels, loc="lower right", fontsize=7, framealpha=0.8))
    if params:  # the last legend is the axes' own, which the layout keeps inside the figure
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), ncols=columns, fontsize=7, frameon=False,
                  title="parameter (thin: bias / norm)", title_fontsize=7, alignment="left",
                  handlelength=1.8, columnspacing=1.0, borderaxespad=0.0)
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

"""The histograms of a run read back from ``histograms.jsonl``, and the picture of the update's histogram
over the logged steps: one heatmap per layer, the fixed bins of :mod:`monitored_optim.histograms` up
the y axis (signed powers of two), the logged steps along x, the share of the layer's elements as colour.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..histograms import EDGES, KEYS, NBINS, ZERO
from ..tags import split as split_tag
from .errors import ReportError, quote, reason, require
from .plot import _chosen, _drawing, _figure, _label_steps, _save
from .read import Run, _is_cut
from .records import Param
from .summary import kind_of, rows_noun
from .table import shorten

FILE = "histograms.jsonl"
HANDFUL = 6
"""Layers :func:`plot_histograms` draws by default: the matrices whose updates hold the largest share
of exact zeros (a frozen or rounded-away layer, which has no update-to-data ratio), then those with
the highest and lowest median update-to-data ratio, as the line plot chooses them."""
UPDATE = KEYS["u"]
"""The series drawn: ``update_hist``."""


@dataclass
class Histograms:
    """The histograms of a run: ``counts[tag][step]`` is the dense list of
    :data:`~monitored_optim.histograms.NBINS` counts.

    Attributes:
        path: the ``histograms.jsonl`` that was read.
        steps: every logged step with a histogram, ascending.
        counts: tag -> {step: counts}, tags in first-appearance order, steps ascending.
    """

    path: Path
    steps: list[int] = field(default_factory=list)
    counts: dict[str, dict[int, list[int]]] = field(default_factory=dict)


def load_histograms(run_dir: str | Path) -> Histograms:
    """Read ``{run_dir}/histograms.jsonl`` (the jsonl backend's, with the ``histograms`` family on).

    A line cut short by a crash is skipped, as in ``metrics.jsonl``; a step not after a tag's previous
    one (a restart appending to the file) drops that tag's later points first.

    Raises:
        ReportError: the file is missing, unreadable, holds a malformed line (``file:line`` named),
            bins other than :data:`~monitored_optim.histograms.EDGES`, or no histogram.
    """
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise ReportError(f"{path}: no such file; histograms are written there by the jsonl backend with the "
                          f'histograms family on (MonitorConfig(figures="...,histograms"))')
    try:
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot read ({reason(exc)})") from None
    out = Histograms(path)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            step, row = _parse(line)
        except ValueError as exc:
            if _is_cut(line):
                continue
            raise ReportError(f"{path}:{number}: corrupt line ({exc}); expected one JSON object per line like "
                              '{"step": 10, "edges": [...], '
                              '"update_hist/fc1.weight": {"start": 40, "counts": [3]}}') from None
        for tag, counts in row.items():
            points = out.counts.setdefault(tag, {})
            for old in [s for s in points if s >= step]:
                del points[old]
            points[step] = counts
    out.steps = sorted({step for points in out.counts.values() for step in points})
    if not out.steps:
        raise ReportError(f"{path}: no histograms in the file")
    return out


def _parse(line: str) -> tuple[int, dict[str, list[int]]]:
    """``(step, {tag: dense counts})`` of one line; ``ValueError`` saying what is wrong."""
    try:
        obj = json.loads(line)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    step = obj.pop("step", None)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f'"step" is {quote(step)}, not an integer')
    if obj.pop("edges", None) != list(EDGES):
        raise ValueError(f'"edges" are not the {len(EDGES)} fixed edges of monitored_optim.histograms')
    row = {}
    for tag, hist in obj.items():
        start = hist.get("start") if isinstance(hist, dict) else None
        counts = hist.get("counts") if isinstance(hist, dict) else None
        if (isinstance(start, bool) or not isinstance(start, int) or not isinstance(counts, list)
                or not 0 <= start <= NBINS - len(counts)
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)):
            raise ValueError(f"{quote(tag)} is {quote(hist)}, not {{\"start\": bin, \"counts\": [counts]}} within "
                             f"{NBINS} bins")
        row[tag] = [0] * start + counts + [0] * (NBINS - start - len(counts))
    return step, row


def layers(hists: Histograms, run: Run | None = None, params: str | None = None) -> list[Param]:
    """The layers :func:`plot_histograms` draws: those matching the glob ``params``, else
    :data:`HANDFUL` matrices: those with exact zeros in their updates (most first, at most half),
    then the report's choice in ``run``, then the others with an update histogram.

    Raises:
        ReportError: ``params`` matches no layer with an update histogram, or none has one.
    """
    drawn: dict[Param, None] = {}  # an ordered set
    for tag in hists.counts:
        parsed = split_tag(tag)
        if parsed is not None and parsed[1] == UPDATE:
            drawn[Param(parsed[0], parsed[2])] = None
    found = list(drawn)
    if not found:
        raise ReportError(f"{hists.path}: no {UPDATE}/ histograms to draw")
    if params is not None:
        picked = [p for p in found if fnmatch.fnmatchcase(p.label, params)]
        if not picked:
            raise ReportError(f"{hists.path}: --params {quote(params)} matches no layer with an update histogram "
                              f"(labels look like {quote(found[0].label)})")
        return picked
    matrices = [p for p in found if run is None or kind_of(run, p) == "matrix"] or found
    try:
        usual = [p for p in _chosen(run, None) if p in matrices] if run is not None else []
    except ReportError:
        usual = []
    if len(usual) > HANDFUL:
        usual = usual[:HANDFUL // 2] + usual[-(HANDFUL - HANDFUL // 2):]
    zeros = {p: _zero_share(hists, p) for p in matrices}
    frozen = sorted((p for p in matrices if zeros[p] > 0), key=lambda p: -zeros[p])[:HANDFUL // 2]
    ordered = list(dict.fromkeys(frozen + usual + matrices))[:HANDFUL]
    return [p for p in found if p in ordered]


def _zero_share(hists: Histograms, param: Param) -> float:
    """The share of ``param``'s update elements in the zero bin, over all its logged steps."""
    steps = hists.counts[param.tag(UPDATE)].values()
    total = sum(sum(counts) for counts in steps)
    return sum(counts[ZERO] for counts in steps) / total if total else 0.0


@_drawing
def plot_histograms(run: Run, path: str | Path, *, params: str | None = None, dpi: int = 110) -> Path:
    """Draw the update histogram over the logged steps of a few layers of ``run`` and save it at ``path``.

    One heatmap per layer (:func:`layers`): x the logged steps, y the fixed bins (signed powers of
    two, the zero bin marked), colour the share of the layer's elements in the bin at that step,
    on a log scale (white: none). From ``{run.path}/histograms.jsonl`` (:func:`load_histograms`).

    Returns:
        The path written (``.png`` added where ``path`` has no suffix), as a :class:`~pathlib.Path`.

    Raises:
        ReportError: as :func:`load_histograms` and :func:`layers`; matplotlib is missing; the file
            cannot be written.
    """
    require("matplotlib", "matplotlib")
    hists = load_histograms(run.path)
    chosen = layers(hists, run, params)
    shown = _rows(hists, chosen)
    columns = 2 if len(chosen) > 3 else 1
    rows = math.ceil(len(chosen) / columns)
    fig = _figure(figsize=(6.0 * columns, 0.8 + rows * max(2.4, len(shown) * 0.075)))
    axes = fig.subplots(rows, columns, squeeze=False, sharex=True)
    for ax in axes.flat[len(chosen):]:
        ax.set_visible(False)
    for ax, param in zip(axes.flat, chosen):
        image = _draw_layer(ax, hists, param, shown)
    for ax in axes[-1]:
        _label_steps(ax, hists.steps)
    bar = fig.colorbar(image, ax=list(axes.flat), shrink=0.6, pad=0.01)
    bar.set_label("share of the layer's elements", fontsize=8)
    fig.suptitle(f"{run.path.resolve().name}: histogram of the update p_after - p_before, {len(chosen)} "
                 f"{rows_noun(chosen)} × {len(hists.steps)} logged steps", fontsize=11)
    return _save(fig, path, dpi)


def _rows(hists: Histograms, chosen: list[Param]) -> list[int]:
    """The bins drawn, ascending: each bin non-empty in a chosen layer at some step, its neighbours, and
    the zero bin (the empty bins between, often the forty between ±2**-20 and 0, are left out)."""
    used = {i for p in chosen for counts in hists.counts[p.tag(UPDATE)].values() for i, c in enumerate(counts) if c}
    return sorted({j for i in used for j in (i - 1, i, i + 1) if 0 <= j < NBINS} | {ZERO})


def _draw_layer(ax, hists: Histograms, param: Param, shown: list[int]):
    """One heatmap: the bins ``shown`` up (a dashed line where bins are left out), logged steps across;
    the image, for the colour bar."""
    import numpy as np
    from matplotlib.colors import LogNorm

    column = {step: i for i, step in enumerate(hists.steps)}
    share = np.full((len(shown), len(hists.steps)), np.nan)
    for step, counts in hists.counts[param.tag(UPDATE)].items():
        total = sum(counts)
        if total:
            share[:, column[step]] = np.array([counts[i] for i in shown], dtype=float) / total
    cmap = require("matplotlib", "matplotlib").colormaps["viridis"].with_extremes(bad="white", under="white")
    image = ax.imshow(np.ma.masked_less_equal(share, 0), aspect="auto", origin="lower", interpolation="nearest",
                      cmap=cmap, norm=LogNorm(vmin=1e-4, vmax=1.0),
                      extent=(-0.5, len(hists.steps) - 0.5, -0.5, len(shown) - 0.5))
    row = shown.index(ZERO)
    ax.axhspan(row - 0.5, row + 0.5, color="tab:red", alpha=0.15, lw=0)
    for k in range(len(shown) - 1):
        if shown[k + 1] - shown[k] > 1:
            ax.axhline(k + 0.5, color="0.35", lw=0.8, ls=(0, (4, 3)))
    stride = max(1, math.ceil(len(shown) / 14))
    ends = {k for k in (0, len(shown) - 1) if shown[k] in (0, NBINS - 1)}  # an open outer bin is always named
    ticks = sorted(ends | {k for k in range(len(shown)) if (k - row) % stride == 0
                           and all(abs(k - end) >= max(2, stride // 2) for end in ends)})
    ax.set_yticks(ticks, [_bin_label(shown[k]) for k in ticks], fontsize=7)
    ax.set_ylabel("update: bin by its edge nearer 0", fontsize=7)
    ax.set_title(shorten(param.label, 60), fontsize=9)
    return image


def _bin_label(i: int) -> str:
    """Bin ``i`` named by its edge nearer zero, in mathtext: ``2^{-10}`` for [2**-10, 2**-9),
    ``-2^{-10}`` for [-2**-9, -2**-10), ``0`` for the zero bin; ``≥2^{16}`` and ``<-2^{16}`` outside."""
    if i == ZERO:
        return "0"
    edge = EDGES[i - 1] if i > ZERO else EDGES[i]
    power = f"{'-' if edge < 0 else ''}2$^{{{round(math.log2(abs(edge)))}}}$"
    return ("≥" if i == NBINS - 1 else "<" if i == 0 else "") + power

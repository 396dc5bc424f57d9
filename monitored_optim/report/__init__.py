"""Read a run back and report it: a per-layer table and the update-to-data plot.

    python -m monitored_optim report RUN_DIR [--plot FILE.png] [--params GLOB] [--heatmap FILE.png]
        [--histograms FILE.png] [--last N]

Modules, one concern each, in the order data flows:

- ``read``: ``load_run(dir) -> Run`` from ``metrics.jsonl`` (preferred, exact) or TensorBoard event
  files (``tensorboard`` package).
- ``records``: a parameter, its row's figures, the run-wide counts, the healthy band.
- ``summary``: ``summarize(run, last) -> Summary``, latest values, medians and marks per parameter.
- ``table``: the ``Summary`` and ``print_report(summary)``, which renders it with ``rich``.
- ``plot``: ``plot_run(run, path)`` (a few parameters' lines and the global norms) and
  ``plot_heatmap(run, path)`` (every parameter) draw it with matplotlib (Agg).
- ``histograms``: ``load_histograms(dir)`` reads ``histograms.jsonl`` (the ``histograms`` family);
  ``plot_histograms(run, path)`` draws a few layers' update histogram over the logged steps.

The optional packages (``tensorboard``, ``rich``, ``matplotlib``) come with
``pip install 'monitored_optim[report]'``; they are imported only when needed, and a missing one
raises :class:`~monitored_optim.report.errors.ReportError` saying so.

Example::

    from monitored_optim.report import load_run, summarize, print_report, plot_run
    run = load_run("runs/exp1")
    print_report(summarize(run, last=20))
    plot_run(run, "exp1.png")
"""

from .errors import ReportError
from .histograms import Histograms, load_histograms, plot_histograms
from .plot import draw_run, plot_heatmap, plot_run
from .read import Run, load_run, split_tag
from .records import HEALTHY_BAND, REFERENCE, Count, Figure, Layer, Param
from .summary import kind_of, parameters, rows_noun, summarize
from .table import Summary, print_report, render, shorten, to_text

__all__ = ["HEALTHY_BAND", "REFERENCE", "Count", "Figure", "Histograms", "Layer", "Param", "ReportError", "Run",
           "Summary",
           "draw_run", "kind_of", "load_histograms", "load_run", "parameters", "plot_heatmap", "plot_histograms",
           "plot_run", "print_report", "render",
           "rows_noun", "shorten", "split_tag", "summarize", "to_text"]

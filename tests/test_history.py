"""In memory, for notebooks: ``opt.monitor.history()`` (a pandas DataFrame of the logged figures,
bounded), ``opt.monitor.plot()`` (the report's update-to-data figure) and ``opt.monitor.report()``
(the report table, rendered as HTML by Jupyter), compared with ``metrics.jsonl`` of the same run."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import gc as _gc

import pytest
import torch
from torch import nn

import models
from test_backends import read_jsonl
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.history import History

pd = pytest.importorskip("pandas")


def train(steps: int, **config) -> torch.optim.Optimizer:
    return models.train(models.mlp(), steps, **config)


def test_history_is_one_row_per_logging_step_one_column_per_tag(tmp_path):
    opt = train(10, backend="jsonl", logdir=tmp_path, every=2)
    frame = opt.monitor.history()
    assert isinstance(frame, pd.DataFrame)
    expected = read_jsonl(tmp_path)
    assert list(frame.index) == [2, 4, 6, 8, 10] and frame.index.name == "step"
    assert list(frame.columns) == list(dict.fromkeys(tag for row in expected.values() for tag in row))
    for step, row in expected.items():
        for tag in frame.columns:
            want = np.float32(row[tag]) if tag in row else np.nan
            assert frame.at[step, tag] == want or (math.isnan(want) and math.isnan(frame.at[step, tag])), (step, tag)


def test_history_is_bounded_and_spans_the_whole_run():
    history = History(capacity=1000)
    for k in range(1, 1001):  # 1,000 logging steps of 10 figures, then an 11th figure appears
        figures = {f"update_to_data/l{i}": k + i / 10 for i in range(10 if k < 500 else 11)}
        history.record(10 * k, figures)
        assert history.nbytes <= 1000 * 4  # float32 values, at most ``capacity`` of them
    frame = history.frame()
    steps = list(frame.index)
    assert 50 <= len(steps) <= 100
    assert steps[0] == 10 and steps[-1] == 10_000  # the first step and the last one
    stride = steps[1] - steps[0]
    assert all(b - a == stride for a, b in zip(steps[:-2], steps[1:-1])), steps  # evenly spaced
    assert frame.at[steps[3], "update_to_data/l2"] == np.float32(steps[3] / 10 + 0.2)
    assert math.isnan(frame.at[10, "update_to_data/l10"]) and frame.at[10_000, "update_to_data/l10"] == np.float32(1001)


def test_history_without_pandas_names_the_extra(tmp_path):
    script = textwrap.dedent("""
        import sys, torch
        sys.modules["pandas"] = None  # as if pandas were not installed
        from monitored_optim import Monitored, MonitorConfig
        p = torch.nn.Parameter(torch.randn(4, 4))
        opt = Monitored(torch.optim.SGD)([("w", p)], lr=0.1, monitor=MonitorConfig(backend="none", every=1))
        p.grad = torch.ones(4, 4)
        opt.step()
        try:
            opt.monitor.history()
        except ImportError as err:
            print(err)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(Path(__file__).parents[1]), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "pandas" in done.stdout and "pip install 'monitored_optim[notebook]'" in done.stdout, done.stdout


def test_plot_returns_the_reports_figure_of_the_chosen_parameters(tmp_path):
    from matplotlib.figure import Figure

    opt = train(6, backend="none")
    fig = opt.monitor.plot(params="fc1.*")
    assert isinstance(fig, Figure)
    top = fig.axes[0]
    assert sorted(line.get_label() for line in top.get_lines() if not line.get_label().startswith("_")) == [
        "fc1.bias (vector)", "fc1.weight"]
    (drawn,) = [line for line in top.get_lines() if line.get_label() == "fc1.weight"]
    assert list(drawn.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert drawn.get_ydata()[-1] == pytest.approx(opt.monitor.latest["update_to_data/fc1.weight"], rel=1e-6)
    fig.savefig(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
    assert fig._repr_png_().startswith(b"\x89PNG\r\n\x1a\n")  # what Jupyter shows, pyplot imported or not
    assert "MonitoredAdamW: update-to-data ratio (memory; 2 of 4 parameters)" in fig.get_suptitle()


def test_report_renders_as_html_and_text():
    opt = train(6, backend="none")
    summary = opt.monitor.report(last=3)
    assert [layer.name for layer in summary.layers] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                                         "unused.weight", "unused.bias"]
    assert summary.window == [4, 5, 6]
    html = summary._repr_html_()
    assert html.lstrip().startswith("<") and "fc2.weight" in html and "u/d" in html and "no grad" in html
    text = repr(summary)
    assert text.startswith("MonitoredAdamW  (memory, 6 logged steps, last step 6)")
    assert "fc1.weight" in text and "verdict" in text and "<" not in text


def test_plot_and_report_before_any_logging_step_say_so():
    from monitored_optim.report import ReportError

    opt = train(3, backend="none", every=10)
    assert opt.monitor.history().empty
    for show in (opt.monitor.plot, opt.monitor.report):
        with pytest.raises(ReportError, match="nothing logged yet"):
            show()

def test_a_run_whose_figures_the_report_does_not_read_says_so():
    """``figures="update_lost"`` on float32 logs nothing the report reads: report() says so in one
    line instead of returning a table that cannot be shown."""
    from monitored_optim.report import ReportError

    m = nn.Linear(4, 3)
    opt = Monitored(torch.optim.AdamW)(m.named_parameters(), lr=1e-3,
                                       monitor=MonitorConfig(backend="none", every=1, figures="update_lost"))
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(ReportError, match="nothing to report"):
        opt.monitor.report()


@pytest.mark.parametrize("last,error", [(1.5, TypeError), ("3", TypeError), (True, TypeError), (0, ValueError)])
def test_report_takes_a_positive_int(last, error):
    m = nn.Linear(4, 3)
    opt = Monitored(torch.optim.AdamW)(m.named_parameters(), lr=1e-3, monitor=MonitorConfig(backend="none", every=1))
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(error, match="last must be an int >= 1"):
        opt.monitor.report(last)


def test_the_in_memory_report_knows_vectors_once_the_optimizer_is_gone():
    """Kinds come from the shapes the logging steps delivered: a LayerNorm gain stays a vector (not
    judged by the band) after the optimizer is collected."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), lr=1e-1,
                                       monitor=MonitorConfig(backend="none", every=1))
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    monitor = opt.monitor
    del opt
    _gc.collect()
    layers = {layer.name: layer for layer in monitor.report().layers}
    assert layers["1.weight"].kind == "vector" and layers["0.weight"].kind == "matrix"
    assert "vector" in layers["1.weight"].marks

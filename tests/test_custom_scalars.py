"""TensorBoard's Custom Scalars tab: the event files carry a layout with one chart per figure series
(every layer's ``update_to_data`` in one chart, each norm in one), read back from a real TensorBoard
server started on the run directory, through the HTTP API its web page uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tensorboard_server import get, tensorboard  # noqa: F401 (a fixture)
from monitored_optim import Monitored, MonitorConfig

pytest.importorskip("tensorboard")

SERIES = ("update_to_data", "grad_to_data", "update_norm", "grad_norm", "param_norm")


class Deep(nn.Module):
    """Eight identical layers and a head: grouped by depth over a small tag budget."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def train(logdir: Path, start: int = 0, prefixes: tuple[str | None, ...] = (None,),
          **config) -> torch.optim.Optimizer:
    """Three steps of ``Deep`` with a monitored AdamW per prefix (stepped in turn: a GAN's optimizers), the
    step axis continuing from ``start``; the last optimizer."""
    pairs = []
    for prefix in prefixes:
        model = Deep()
        opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-2, monitor=MonitorConfig(
            backend="tensorboard", logdir=logdir, prefix=prefix, **config))
        opt.monitor.step = start
        pairs.append((model, opt))
    x = torch.randn(4, 16, 4)
    for i in range(3):
        for model, opt in pairs:
            opt.zero_grad()
            model(x[i]).pow(2).mean().backward()
            opt.step()
    for _, opt in pairs:
        opt.monitor.close()
    return opt


def charts(layout: dict) -> dict[str, list[str]]:
    """``category/chart title`` -> its tag regexes, from the layout TensorBoard serves."""
    return {f"{category['title']}/{chart['title']}": chart["multiline"]["tag"]
            for category in layout["category"] for chart in category["chart"]}


def lines(port: int, run: str, regexes: list[str]) -> set[str]:
    """The tags the Custom Scalars tab draws in a chart of ``regexes`` for ``run`` (its own query)."""
    out = set()
    for regex in regexes:
        answer = get(port, "/data/plugin/custom_scalars/scalars", run=run, tag=regex)
        assert answer["regex_valid"], regex
        out |= set(answer["tag_to_events"])
    return out


def test_custom_scalars_tab_has_one_chart_per_series(tmp_path, tensorboard):
    layers = train(tmp_path / "runs" / "layers")
    with pytest.warns(UserWarning, match="tags per logging step even grouped by depth"):
        grouped = train(tmp_path / "runs" / "grouped", tag_budget=20, prefixes=("gen",))
    train(tmp_path / "runs" / "shared", prefixes=("g", "d"))  # a GAN's two optimizers in one logdir
    port = tensorboard(tmp_path / "runs", {"layers", "grouped", "shared"})
    layout = charts(get(port, "/data/plugin/custom_scalars/layout"))  # read with the runs' scalars
    tags = get(port, "/data/plugin/scalars/tags")
    for series in SERIES:
        # one chart with every layer's figure of the series
        every_layer = {tag for tag in layers.monitor.latest if tag.startswith(series + "/")}
        assert len(every_layer) >= 17  # every parameter (a one-element bias has no ratio)
        assert every_layer <= set(tags["layers"])
        assert lines(port, "layers", layout[_chart(series)]) == every_layer
        # over the tag budget: every depth group's min, median and max, and the head's own
        drawn = lines(port, "grouped", layout[_chart(series, "gen/")])
        groups = {f"gen/{series}/layers.*.{kind}/{stat}" for kind in ("weight", "bias")
                  for stat in ("min", "median", "max")}
        head = {f"gen/{series}/head.weight", f"gen/{series}/head.bias"} & set(grouped.monitor.latest)
        assert drawn == groups | head, drawn
        assert drawn <= set(tags["grouped"])
    assert lines(port, "layers", layout[_chart("global")]) == {
        "global/update_norm", "global/grad_norm", "global/param_norm"}
    assert lines(port, "layers", layout[_chart("lr")]) == {"lr/group0"}
    assert {"health/no_grad", "health/nonfinite"} <= lines(port, "layers", layout[_chart("health")])
    assert set(grouped.monitor.latest) >= {f"gen/update_to_data/layers.{i}.weight" for i in range(8)}
    for prefix in ("g/", "d/"):  # TensorBoard shows one layout per run directory: it has both
        assert lines(port, "shared", layout[_chart("update_to_data", prefix)]) == {
            f"{prefix}update_to_data/{name}" for name, _ in Deep().named_parameters() if name != "head.bias"}
    assert layers.monitor.step == 3


def _chart(series: str, prefix: str = "") -> str:
    """The layout key (category/title) of the chart of ``series``: the category is its family."""
    from monitored_optim.tags import family

    return f"{prefix}{family(series + '/x')}/{prefix}{series}"


def test_layout_is_written_once_per_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    train(tmp_path / "run")
    train(tmp_path / "run", start=3)  # resumed into the same directory: a second event file
    files = sorted((tmp_path / "run").glob("events.out.tfevents.*"))
    assert len(files) == 2
    for file in files:
        configs = [value for event in EventFileLoader(str(file)).Load() for value in event.summary.value
                   if value.metadata.plugin_data.plugin_name == "custom_scalars"]
        assert len(configs) == 1 and configs[0].tag == "custom_scalars__config__"


def test_event_files_of_one_process_sort_in_the_order_they_were_made(tmp_path, monkeypatch):
    """TensorBoard reads a run directory's files in name order and shows the layout it read last: the
    writers' files must sort as they were made (the 10th after the 9th), so that the last layout, which
    holds every writer's charts, wins."""
    import itertools

    from monitored_optim import backends

    monkeypatch.setattr(backends, "_WRITERS", itertools.count(8))
    made = []
    for _ in range(4):  # 8, 9, 10, 11
        before = set(tmp_path.iterdir())
        backends.open_backend("tensorboard", tmp_path).close()
        (new,) = set(tmp_path.iterdir()) - before
        made.append(new.name)
    assert sorted(made) == made

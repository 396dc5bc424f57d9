"""The sinks of the ``histograms`` family: what ``Fanout.histograms`` sends (the counts of real tensors'
updates, grads and weights) is read back bin for bin from each backend's own files (``histograms.jsonl``,
TensorBoard event files and a real TensorBoard server, the offline W&B run, trackio's database, Comet's
offline archive); a backend without a histogram type says so once; the depth groups add up."""

from __future__ import annotations

import bisect
import json
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import trackers
from monitored_optim import grouping
from monitored_optim.backends import Fanout
from monitored_optim.backends.bins import span
from monitored_optim.backends.tensorboard import DBL_MAX
from monitored_optim.histograms import EDGES, KEYS, NBINS, ZERO, Histogram
from monitored_optim.tags import family, per_parameter
from tensorboard_server import get, tensorboard  # noqa: F401 (a fixture)
from test_histograms import record, truth
from wandb_files import read_metric_definitions, read_rows

LIMITS = (-2.0 ** 17, *EDGES, 2.0 ** 17)
"""The drawn edges of every bin: the open outer bins end one power of two beyond 2**16."""
MIDDLES = [(a + b) / 2 for a, b in zip(LIMITS, LIMITS[1:])]

Steps = list[tuple[int, dict[str, float], dict[str, Histogram]]]


def training(steps: int = 3, prefix: str = "") -> Steps:
    """``(step, figures, histograms)`` of each step of a small SGD run, counted from clones as the
    monitor counts them: three layers of one kind (a depth group), a head, and a table that the loss
    does not use (no grad: an empty ``grad_hist``, an update of exact zeros) with weights beyond
    ``2**16`` (the open outer bins). Each histogram holds the exact min, max and sums of the clone."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"h": nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)]), "head": nn.Linear(8, 2),
                           "table": nn.Embedding(2, 2)})
    with torch.no_grad():
        model["table"].weight[0] = torch.tensor([1e5, -3e5])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(1, steps + 1):
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        opt.zero_grad()
        x = model["h"](torch.randn(16, 8))
        model["head"](x).pow(2).mean().backward()
        opt.step()
        hists = {}
        for name, p in model.named_parameters():
            seen = {"u": p.detach() - before[name], "param": p.detach(),
                    "grad": p.grad if p.grad is not None else torch.empty(0)}
            for key, series in KEYS.items():
                hists[f"{prefix}{series}/{name}"] = truth(seen[key])
        figures = {f"{prefix}global/update_norm": float(step)}
        out.append((step, figures, hists))
    return out


def send(names: tuple[str, ...], logdir: Path, steps: Steps, **options) -> Fanout:
    fanout = Fanout(names, logdir, strict=True, **options)
    for step, figures, hists in steps:
        fanout.log(figures, step)
        fanout.histograms(hists, step)
    fanout.close()
    return fanout


def dense(start: int, kept: list[int]) -> list[int]:
    out = [0] * NBINS
    out[start:start + len(kept)] = kept
    return out


def from_edges(edges: list[float], values: list[int]) -> Histogram:
    """The dense counts, min and max of a histogram drawn from its min to its max, its inner edges
    those of the fixed bins (:data:`LIMITS`); without sums (a dashboard's histogram has none)."""
    start = min(max(bisect.bisect_right(LIMITS, edges[0]) - 1, 0), NBINS - 1)  # the bin of the min
    assert edges[1:-1] == list(LIMITS[start + 1:start + len(values)]), edges
    assert edges[0] <= edges[-1]
    return Histogram(dense(start, values), edges[0], edges[-1])


def extent(hists: dict[str, Histogram]) -> dict[str, tuple]:
    """Each histogram's counts, min and max."""
    return {tag: (list(h), h.min, h.max) for tag, h in hists.items()}


def nonempty(hists: dict[str, Histogram]) -> dict[str, Histogram]:
    return {tag: c for tag, c in hists.items() if any(c)}


def test_the_histograms_are_real_and_reach_every_kind_of_bin():
    _, _, hists = training(1)[0]
    assert len(hists) == 3 * 9 and all(len(c) == NBINS for c in hists.values())
    assert hists["param_hist/table.weight"][0] == 1 and hists["param_hist/table.weight"][-1] == 1  # -3e5, 1e5
    assert not any(hists["grad_hist/table.weight"]) and hists["update_hist/table.weight"][ZERO] == 4
    moved = hists["update_hist/h.1.weight"]
    assert sum(moved) == 64 and moved[0] == moved[ZERO] == moved[-1] == 0
    assert per_parameter("update_hist/h.0.weight") == ("update_hist", "h.0.weight")
    assert {family(f"{series}/x") for series in KEYS.values()} == {"histograms"}


def test_histograms_jsonl_holds_each_step_bin_for_bin(tmp_path):
    steps = training(3)
    send(("jsonl",), tmp_path, steps)
    rows = [json.loads(line) for line in (tmp_path / "histograms.jsonl").read_text().splitlines()]
    assert [row.pop("step") for row in rows] == [1, 2, 3]
    for row, (_, _, hists) in zip(rows, steps):
        assert row.pop("edges") == list(EDGES)
        assert {tag: record(from_jsonl(h)) for tag, h in row.items()} == {tag: record(h) for tag, h in hists.items()}
        assert all(not h["counts"] or h["counts"][0] and h["counts"][-1] for h in row.values())  # trimmed
    assert rows[0]["grad_hist/table.weight"] == {"start": 0, "counts": [], "sum": 0.0, "sum_squares": 0.0}
    assert rows[0]["param_hist/table.weight"]["min"] == -3e5 and rows[0]["param_hist/table.weight"]["max"] == 1e5
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0]) == {"step": 1, **steps[0][1]}


def test_histograms_jsonl_is_made_only_by_histograms_and_starts_a_line_after_a_cut_row(tmp_path):
    send(("jsonl",), tmp_path / "plain", [(1, {"global/update_norm": 1.0}, {})][:1], )
    Fanout(("jsonl",), tmp_path / "none", strict=True).log({"global/update_norm": 1.0}, 1)
    assert not (tmp_path / "none" / "histograms.jsonl").exists()
    steps = training(2)
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "histograms.jsonl").write_text('{"step": 7, "edges": [-65536.0, ')
    send(("jsonl",), tmp_path / "cut", steps)
    lines = (tmp_path / "cut" / "histograms.jsonl").read_text().split("\n")
    assert lines[0] == '{"step": 7, "edges": [-65536.0, ' and [json.loads(x)["step"] for x in lines[1:-1]] == [1, 2]


def from_jsonl(h: dict) -> Histogram:
    """A histogram of a ``histograms.jsonl`` line (``start``, ``counts``, ``min``, ``max``, ``sum``,
    ``sum_squares``; no ``min`` and ``max`` for an empty one)."""
    assert set(h) == {"start", "counts", "sum", "sum_squares"} | ({"min", "max"} if h["counts"] else set()), h
    return Histogram(dense(h["start"], h["counts"]), h.get("min"), h.get("max"), h["sum"], h["sum_squares"])


def tensorboard_histograms(logdir: Path) -> dict[int, dict[str, Histogram]]:
    """Per step, each ``HistogramProto`` of the event files in ``logdir`` as the dense counts of its
    buckets (the fixed bins' right edges) with its ``min``, ``max``, ``sum`` and ``sum_squares``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"histograms": 0})
    acc.Reload()
    out: dict[int, dict[str, Histogram]] = {}
    for tag in acc.Tags()["histograms"]:
        for event in acc.Histograms(tag):
            h = event.histogram_value
            limits = [*h.bucket_limit[:-1], LIMITS[-1] if h.bucket_limit[-1] == DBL_MAX else h.bucket_limit[-1]]
            stop = LIMITS.index(limits[-1])  # one past the last bin written
            start = stop - len(h.bucket)
            assert limits == list(LIMITS[start + 1:stop + 1]), tag
            out.setdefault(event.step, {})[tag] = Histogram(dense(start, [int(c) for c in h.bucket]), h.min, h.max,
                                                            h.sum, h.sum_squares)
            assert h.num == sum(h.bucket)
            assert (start == 0 or LIMITS[start] <= h.min) and h.min <= h.max \
                and (stop == NBINS or h.max < LIMITS[stop]), tag  # in the first and the last bin
    return out


def test_tensorboard_event_files_hold_each_histogram_bin_for_bin(tmp_path):
    steps = training(3)
    send(("tensorboard",), tmp_path, steps)
    written = tensorboard_histograms(tmp_path)
    assert {step: {t: record(h) for t, h in hists.items()} for step, hists in written.items()} \
        == {step: {t: record(h) for t, h in nonempty(hists).items()} for step, _, hists in steps}


def until_steps(port: int, plugin: str, tag: str, steps: list[int]) -> list:
    """The server's answer for ``tag`` of run ``a`` in ``plugin``'s tab, once it has read ``steps`` (it
    reads the event file while it serves it)."""
    for _ in range(60):
        answer = get(port, f"/data/plugin/{plugin}/{plugin}", run="a", tag=tag)
        if [step for _, step, _ in answer] == steps:
            return answer
        time.sleep(0.5)
    raise AssertionError(f"TensorBoard's {plugin} of {tag} did not reach steps {steps}: {answer}")


def test_tensorboard_shows_the_histograms_and_distributions_tabs(tmp_path, tensorboard):
    steps = training(3)
    send(("tensorboard",), tmp_path / "runs" / "a", steps)
    port = tensorboard(tmp_path / "runs", {"a"})
    tag = "update_hist/h.1.weight"
    assert tag in get(port, "/data/plugin/histograms/tags")["a"]
    shown = until_steps(port, "histograms", tag, [1, 2, 3])
    for (_, _, buckets), (_, _, hists) in zip(shown, steps):
        start, stop = span(hists[tag])
        drawn = [hists[tag].min, *LIMITS[start + 1:stop], hists[tag].max]  # from the exact min to the exact max
        assert [edge for left, right, _ in buckets for edge in (left, right)] == \
            pytest.approx([edge for i in range(stop - start) for edge in drawn[i:i + 2]], rel=1e-7)  # float32 there
        assert [count for _, _, count in buckets] == hists[tag][start:stop]
    distributions = until_steps(port, "distributions", tag, [1, 2, 3])
    for (_, _, points), (_, _, hists) in zip(distributions, steps):
        start, stop = span(hists[tag])
        assert [bp for bp, _ in points] == [0, 668, 1587, 3085, 5000, 6915, 8413, 9332, 10000]
        values = [value for _, value in points]
        assert values == sorted(values) and values[0] == pytest.approx(hists[tag].min, rel=1e-7) \
            and values[-1] == pytest.approx(hists[tag].max, rel=1e-7)  # the exact extremes, not bin edges


def test_wandb_run_holds_each_histogram_at_its_optimizer_step(tmp_path):
    steps = training(3)
    send(("wandb",), tmp_path, steps)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = [row for row in read_rows(run_dir) if any(key.endswith("/_type") for key in row)]
    assert [row["optimizer/step"] for row in rows] == [1, 2, 3]
    for row, (_, _, hists) in zip(rows, steps):  # W&B keeps a histogram as {tag}/_type, /values, /bins
        shown = [key[:-len("/_type")] for key, value in row.items() if key.endswith("/_type") and value == "histogram"]
        assert extent({tag: from_edges(row[f"{tag}/bins"], row[f"{tag}/values"]) for tag in shown}) \
            == extent(nonempty(hists))
    definitions = read_metric_definitions(run_dir)
    assert all(definitions[f"{series}/*"] == "optimizer/step" for series in KEYS.values()), definitions


def comet_histograms(tmp_path: Path) -> dict[int, dict[str, dict[int, int]]]:
    """``{step: {name: {Comet bin index: count}}}`` from the offline archive's ``histogram3d`` files."""
    (path,) = tmp_path.rglob("*.zip")
    out: dict[int, dict[str, dict[int, int]]] = {}
    with zipfile.ZipFile(path) as archive:
        for message in map(json.loads, archive.read("messages.json").decode().splitlines()):
            params = message["payload"].get("additional_params") or {}
            if message["type"] == "file_upload" and params.get("type") == "histogram3d":
                stored = json.loads(archive.read(message["payload"]["file_path"]))
                out.setdefault(params["step"], {})[params["fileName"]] = dict(map(tuple, stored["index_values"]))
    return out


@pytest.mark.parametrize("name", ["trackio", "comet"])
def test_trackio_and_comet_hold_each_histogram_at_its_step(name, tmp_path, monkeypatch, request):
    tracker = trackers.TRACKERS[name]
    tracker.setup(monkeypatch, tmp_path, request.node.name)
    steps = training(2)
    try:
        send((name,), tmp_path, steps)
    finally:
        tracker.cleanup()
    if name == "trackio":
        (rows,) = tracker.runs(tmp_path)
        for step, _, hists in steps:
            shown = {tag: h for tag, h in rows[step].items() if isinstance(h, dict)}
            assert all(h["_type"] == "trackio.histogram" for h in shown.values())
            drawn = {tag: from_edges(h["bins"], h["values"]) for tag, h in shown.items()}
            assert extent(drawn) == extent(nonempty(hists))
        return
    from comet_ml.data_structure import Histogram

    comet = Histogram()
    stored = comet_histograms(tmp_path)
    for step, _, hists in steps:
        expected = {tag: {comet.get_bin_index(MIDDLES[i]): c for i, c in enumerate(h) if c}
                    for tag, h in nonempty(hists).items()}
        assert stored[step] == expected


def test_a_backend_without_histograms_says_so_once_and_keeps_its_figures(tmp_path, monkeypatch, request):
    trackers.TRACKERS["swanlab"].setup(monkeypatch, tmp_path, request.node.name)
    fanout = Fanout(("swanlab", "jsonl"), tmp_path, strict=True)
    steps = training(2)
    try:
        with pytest.warns(UserWarning) as caught:
            for step, figures, hists in steps:
                fanout.log(figures, step)
                fanout.histograms(hists, step)
    finally:
        fanout.close()
    notices = [str(w.message) for w in caught if "histograms" in str(w.message)]
    assert len(notices) == 1, notices
    assert "swanlab backend shows no histograms (SwanLab has no histogram type" in notices[0]
    assert "update_hist/, grad_hist/ and param_hist/ are left out there" in notices[0]
    (rows,) = trackers.TRACKERS["swanlab"].runs(tmp_path)
    assert {step: row["global/update_norm"] for step, row in rows.items()} == {1: 1.0, 2: 2.0}
    assert len((tmp_path / "histograms.jsonl").read_text().splitlines()) == 2


def test_mlflow_says_it_has_no_histogram_type():
    from monitored_optim.backends.mlflow import MlflowBackend

    assert "MLflow has no histogram type" in MlflowBackend.NO_HISTOGRAMS


def test_user_sinks_get_histograms_only_if_they_have_the_method(tmp_path):
    class Keeper:
        def __init__(self):
            self.figures, self.hists = {}, {}

        def log(self, metrics, step):
            self.figures[step] = metrics

        def histograms(self, hists, step):
            self.hists[step] = hists

    class Plain:
        def log(self, metrics, step):
            pass

    keeper, seen = Keeper(), []
    steps = training(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        send((), tmp_path, steps, sinks=(keeper, Plain(), lambda metrics, step: seen.append(step)))
    assert {step: {t: record(h) for t, h in hists.items()} for step, hists in keeper.hists.items()} == \
        {step: {t: record(h) for t, h in hists.items()} for step, _, hists in steps} and seen == [1, 2]
    keeper.hists[1]["update_hist/h.0.weight"][0] += 1
    assert keeper.hists[1]["update_hist/h.0.weight"] != steps[0][2]["update_hist/h.0.weight"]  # a copy


def test_a_sink_failing_on_histograms_is_warned_about_once_and_dropped(tmp_path):
    class Broken:
        logged = 0

        def log(self, metrics, step):
            self.logged += 1

        def histograms(self, hists, step):
            raise OSError("no room")

    broken = Broken()
    fanout = Fanout(("jsonl",), tmp_path, strict=False, sinks=(broken,))
    with pytest.warns(RuntimeWarning, match=r"your sink 0 \(Broken\) failed .*OSError: no room") as caught:
        for step, figures, hists in training(2):
            fanout.log(figures, step)
            fanout.histograms(hists, step)
    fanout.close()
    assert len(caught) == 1 and broken.logged == 1
    assert len((tmp_path / "histograms.jsonl").read_text().splitlines()) == 2


def test_depth_groups_add_bin_by_bin_and_the_dashboards_get_them(tmp_path):
    steps = training(2, prefix="gen/")
    _, _, hists = steps[0]
    grouped = grouping.summarize_histograms(hists, prefix="gen/")
    for series in KEYS.values():
        members = [hists[f"gen/{series}/h.{i}.{kind}"] for i in range(3) for kind in ("weight",)]
        assert grouped[f"gen/{series}/h.*.weight"] == [sum(c) for c in zip(*members)]
        group = grouped[f"gen/{series}/h.*.weight"]  # the extremes of the members' elements, their sums added
        assert (group.min, group.max) == (min(h.min for h in members), max(h.max for h in members))
        assert group.sum == pytest.approx(sum(h.sum for h in members), rel=1e-12)
        assert group.sum_squares == pytest.approx(sum(h.sum_squares for h in members), rel=1e-12)
        assert record(grouped[f"gen/{series}/head.weight"]) == record(hists[f"gen/{series}/head.weight"])
        assert f"gen/{series}/h.0.weight" not in grouped
    assert len(grouped) == 3 * 5
    fanout = Fanout(("tensorboard", "jsonl"), tmp_path, strict=True)
    for step, figures, hists in steps:
        fanout.log(figures, step)
        fanout.histograms(hists, step, compact=lambda hists=hists: grouping.summarize_histograms(hists, "gen/"))
    fanout.close()
    assert {step: {t: record(h) for t, h in got.items()} for step, got in tensorboard_histograms(tmp_path).items()} \
        == {step: {t: record(h) for t, h in nonempty(grouping.summarize_histograms(hists, "gen/")).items()}
            for step, _, hists in steps}
    rows = [json.loads(line) for line in (tmp_path / "histograms.jsonl").read_text().splitlines()]
    assert all(set(row) - {"step", "edges"} == set(hists) for row, (_, _, hists) in zip(rows, steps))

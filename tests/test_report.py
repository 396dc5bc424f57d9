"""The report reads runs of both file backends back to the logged values, summarizes the last N logged
steps, draws a real PNG, and fails on bad input with one line on stderr and no traceback."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib import image

import models
import test_backends
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.__main__ import main
from monitored_optim.histograms import EDGES
from monitored_optim.report import (Param, ReportError, Run, kind_of, load_run, parameters, plot_run, rows_noun,
                                    summarize)

PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "unused.weight", "unused.bias"]
EXPECTED = "expected a run directory with metrics.jsonl or TensorBoard event files"


def train(backend: str, logdir: Path, steps: int = 30, every: int = 1):
    """Train the shared tiny MLP with a monitored AdamW logging to ``backend`` in ``logdir``."""
    opt = test_backends.train(backend, logdir, steps=steps, every=every)
    latest = dict(opt.monitor.latest)
    opt.monitor.close()
    return latest


def jsonl_rows(logdir: Path) -> list[dict]:
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monitored_optim", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=180)


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[Path, Path, dict[str, float]]:
    """One 30-step run logged to JSONL and TensorBoard; returns (the run, a copy with only the
    event files, opt.monitor.latest)."""
    root = tmp_path_factory.mktemp("both")
    latest = train("tensorboard,jsonl", root / "run")
    (root / "tb").mkdir()
    for event_file in (root / "run").glob("events.out.tfevents.*"):
        shutil.copy(event_file, root / "tb")
    return root / "run", root / "tb", latest


# ---- reading ---------------------------------------------------------------------------------------

def test_jsonl_run_reads_back_exactly(both):
    run_dir, _, latest = both
    run = load_run(run_dir)
    assert run.source == "jsonl"  # preferred when both exist
    assert run.steps == list(range(1, 31))
    rows = jsonl_rows(run_dir)
    for tag in list(run.series):
        assert run.series[tag] == [(row["step"], row[tag]) for row in rows if tag in row], tag
    assert {tag: points[-1][1] for tag, points in run.series.items()} == latest
    assert list(run.series) == [tag for tag in rows[0] if tag != "step"]  # layer order = file order


def test_tensorboard_run_reads_back_float32_in_the_same_order(both):
    run_dir, tb_dir, latest = both
    run, exact = load_run(tb_dir), load_run(run_dir)
    assert run.source == "tensorboard"
    assert run.steps == exact.steps
    assert list(run.series) == list(exact.series)
    for tag, points in exact.series.items():
        assert [s for s, _ in run.series[tag]] == [s for s, _ in points]
        assert [v for _, v in run.series[tag]] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-30)
    tag = "update_to_data/fc1.weight"
    assert run.series[tag][-1][1] == pytest.approx(latest[tag], rel=1e-6)
    assert [layer.name for layer in summarize(run).layers] == PARAMS


def test_restart_purges_the_old_tail_and_a_truncated_last_line_is_ignored(tmp_path):
    lines = [{"step": s, "update_to_data/w": -3.0 - s} for s in (1, 2, 3)]
    lines += [{"step": s, "update_to_data/w": -2.0 - s} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "upd')
    run = load_run(tmp_path)
    assert run.steps == [1, 2]
    assert run.series["update_to_data/w"] == [(1, -3.0), (2, -4.0)]


def test_two_optimizers_with_tag_prefixes_share_a_logdir(tmp_path):
    opts, problems = {}, {}
    for who in ("gen", "disc"):
        problems[who] = models.mlp()
        opts[who] = Monitored(torch.optim.AdamW)(problems[who].groups, lr=1e-2, monitor=MonitorConfig(
            backend="jsonl", logdir=tmp_path, every=2, prefix=who))
    for i in range(6):
        for who in ("gen", "disc"):
            opts[who].zero_grad()
            problems[who].loss(i).backward()
            opts[who].step()
    latest = {**opts["gen"].monitor.latest, **opts["disc"].monitor.latest}
    for opt in opts.values():
        opt.monitor.close()
    run = load_run(tmp_path)
    assert run.steps == [2, 4, 6]
    assert {tag: points[-1][1] for tag, points in run.series.items()} == latest
    summary = summarize(run, last=2)
    assert [layer.name for layer in summary.layers] == [f"{who}/{n}" for who in ("gen", "disc") for n in PARAMS]
    assert summary.layers[0].update_to_data.latest == latest["gen/update_to_data/fc1.weight"]
    assert "gen/global/grad_norm" in summary.globals and "disc/lr/group1" in summary.globals
    assert all(tag.split("/")[1] == "health" for tag in summary.health)
    assert_real_png(plot_run(run, tmp_path / "gan.png"))


# ---- the table -------------------------------------------------------------------------------------

@pytest.mark.parametrize("every, last", [(1, 7), (3, 4), (1, 100)])
def test_latest_and_medians_over_the_last_n_logged_steps(tmp_path, every, last):
    latest = train("jsonl", tmp_path / "run", steps=30, every=every)
    rows = jsonl_rows(tmp_path / "run")
    window = rows[-last:]
    summary = summarize(load_run(tmp_path / "run"), last=last)
    assert summary.window == [row["step"] for row in window]
    assert [layer.name for layer in summary.layers] == PARAMS
    for layer in summary.layers:
        for kind in ("update_to_data", "grad_to_data", "update_norm"):
            tag = f"{kind}/{layer.name}"
            values = [row[tag] for row in window if tag in row]
            figure = getattr(layer, kind)
            assert figure.latest == latest.get(tag)
            assert figure.median == (statistics.median(values) if values else None)
    unused = {layer.name: layer for layer in summary.layers}["unused.weight"]
    assert unused.update_to_data.latest is None and unused.update_norm.latest == 0.0
    assert unused.marks == ["no grad"]
    health = {tag: value for tag, value in latest.items() if tag.startswith("health/")}  # may be none
    assert {tag: count.latest for tag, count in summary.health.items()} == health


def test_cli_prints_the_table_and_writes_the_plot(both, tmp_path):
    run_dir, _, latest = both
    out = cli("report", str(run_dir), "--last", "7", "--plot", "out.png", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert_real_png(tmp_path / "out.png")
    assert out.stdout.rstrip().endswith("plot written to out.png")
    rows = jsonl_rows(run_dir)[-7:]
    line = next(line for line in out.stdout.splitlines() if " fc1.weight " in line)
    median = statistics.median(row["update_to_data/fc1.weight"] for row in rows)
    assert f"{latest['update_to_data/fc1.weight']:.2f}" in line and f"{median:.2f}" in line
    assert f"{statistics.median(row['update_norm/fc1.weight'] for row in rows):.3g}" in line
    order = [next(i for i, line in enumerate(out.stdout.splitlines()) if f" {name} " in line) for name in PARAMS]
    assert order == sorted(order)
    assert "last 7 logged steps (steps 24-30)" in out.stdout
    assert "no grad" in next(line for line in out.stdout.splitlines() if " unused.bias " in line)


def test_marks_for_the_band_and_health(tmp_path, capsys):
    rows = [{"step": s, "param_norm/a.weight": 1.0, "grad_norm/a.weight": 1.0, "update_to_data/a.weight": -3.0,
             "update_to_data/b.weight": -5.0 + s / 100, "update_to_data/c.weight": -1.0,
             "param_norm/d.bias": 1.0, "update_norm/d.bias": 0.0,
             "param_norm/e.bias": 1.0, "grad_norm/e.bias": 1.0, "update_norm/e.bias": 0.0,
             "param_norm/f.scale": 1.0, "grad_norm/f.scale": 1.0, "update_norm/f.scale": 0.1,
             "health/no_grad": 1.0, "health/unchanged": 1.0, "health/nonfinite": 1.0 if s == 9 else 0.0,
             "health/skipped_steps": 0.0} for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(load_run(tmp_path), last=5)
    marks = {layer.name: layer.marks for layer in summary.layers}
    assert marks == {"a.weight": [], "b.weight": ["below band"], "c.weight": ["above band"],
                     "d.bias": ["no grad"], "e.bias": ["unchanged"], "f.scale": ["no ratio"]}
    assert summary.layers[1].update_to_data.median == pytest.approx(-5.0 + 8 / 100)
    assert list(summary.health) == ["health/no_grad", "health/unchanged", "health/nonfinite", "health/skipped_steps"]
    nonfinite = summary.health["health/nonfinite"]
    assert (nonfinite.latest, nonfinite.worst) == (0.0, 1.0)
    assert summarize(load_run(tmp_path), last=1).health["health/nonfinite"].worst == 0.0  # step 9 left the window

    assert main(["report", str(tmp_path), "--last", "5"]) == 0
    out = capsys.readouterr().out
    assert "nonfinite 0 (1)" in out and "skipped_steps 0 (0)" in out
    assert "below band" in next(line for line in out.splitlines() if " b.weight " in line)


def test_kind_guess_by_name_without_params_json():
    run = Run(Path("."), "jsonl")

    def kind(name):
        return kind_of(run, Param("", name))

    assert kind("fc1.weight") == kind("transformer.h.0.mlp.c_fc.weight") == "matrix"
    assert kind("fc1.bias") == kind("transformer.h.0.ln_1.weight") == "vector"
    assert kind("encoder.LayerNorm.weight") == kind("bn1.weight") == "vector"
    run.kinds["1.weight"] = "vector"  # a Sequential's BatchNorm gain: only the shape tells
    assert kind("1.weight") == "vector"


# ---- the plot --------------------------------------------------------------------------------------

def assert_real_png(path: Path) -> None:
    pixels = image.imread(path)
    height, width = pixels.shape[:2]
    assert height >= 400 and width >= 600
    colours = np.unique(pixels[..., :3].reshape(-1, 3).round(2), axis=0)
    assert len(colours) > 50  # lines, band, text: not one flat colour
    assert pixels[..., :3].std() > 0.05


def test_plot_from_each_backend(both, tmp_path):
    run_dir, tb_dir, _ = both
    for source in (run_dir, tb_dir):
        path = plot_run(load_run(source), tmp_path / f"{source.name}.png")
        assert_real_png(path)


# ---- errors ----------------------------------------------------------------------------------------

def assert_one_line_error(out: subprocess.CompletedProcess, path: Path | str, *words: str) -> None:
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("monitored-optim: error: ") and str(path) in lines[0]
    for word in words:
        assert word in lines[0]


def test_missing_dir_fails_with_one_line(tmp_path):
    assert_one_line_error(cli("report", "nowhere", cwd=tmp_path), "nowhere", "no such directory", EXPECTED)


def test_empty_dir_fails_with_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(cli("report", "empty", cwd=tmp_path), "empty", EXPECTED)


def test_corrupt_jsonl_fails_with_one_line(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "global/grad_norm": 0.5}\nnot json at all\n'
                                                     '{"step": 3, "global/grad_norm": 0.5}\n')
    out = cli("report", "run", "--plot", "x.png", cwd=tmp_path)
    assert_one_line_error(out, Path("run") / "metrics.jsonl", ":2: corrupt line")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("content, words", [
    ("", ["no logged steps"]),
    ('{"step": "one"}\n', ['"step" is']),
    ('{"step": 1}\n', ["no monitored_optim figures"]),
    ('[1, 2]\n', ["not an object"]),
    ('{"step": 1, "global/grad_norm": "big"}\n', ["not a number"]),
])
def test_other_bad_jsonl(tmp_path, capsys, content, words):
    (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "metrics.jsonl") in err
    assert all(word in err for word in words)


def test_not_a_dir_garbage_events_and_parent_of_runs(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "events.out.tfevents.1.host").write_bytes(bytes(range(256)) * 3)
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "metrics.jsonl").write_text('{"step": 1, "global/grad_norm": 0.5}\n')
    for path, word in [("file", "not a directory"), ("garbage", "TensorBoard event files"),
                       ("runs", "runs found in subdirectories: runs/a")]:
        assert main(["report", path]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and word in err, err
    assert main(["report", "runs/a", "--plot", "no/such/dir/x.png"]) == 1
    assert "no/such/dir/x.png: cannot write the plot" in capsys.readouterr().err



@pytest.mark.parametrize("flag", ["--plot", "--heatmap", "--histograms"])
def test_an_image_path_without_a_suffix_or_naming_a_directory(flag, tmp_path, capsys, monkeypatch):
    """A path without a suffix gets ``.png``, as matplotlib saves it, and the message names that file;
    a path that is a directory is one clear line and exit status 1, nothing written beside it."""
    run_dir = tmp_path / "run"
    train("jsonl", run_dir, steps=4)
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    written = {"--plot": "plot", "--heatmap": "heatmap", "--histograms": "histograms"}[flag]
    if flag == "--histograms":
        rows = [{"step": step, "edges": list(EDGES), "update_hist/fc1.weight": {"start": 40, "counts": [1, step, 3]}}
                for step in range(1, 5)]
        (run_dir / "histograms.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["report", "run", flag, "picture"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"{written} written to picture.png")
    assert (tmp_path / "picture.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", "run", flag, "out"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out: is a directory" in err, err
    assert not (tmp_path / "out.png").exists() and not any((tmp_path / "out").iterdir())
    for path, words in [("L" * 300, "cannot write the plot (OSError: [Errno 36] File name too long"),
                        ("", "the image's path is empty")]:
        assert main(["report", "run", flag, path]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err

def test_bad_last_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path), "--last", "0"])
    assert exc.value.code == 2


def test_missing_package_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "update_to_data/w": -3.0}\n')
    script = ("import sys; sys.modules['rich'] = None\n"
              "from monitored_optim.__main__ import main\n"
              f"sys.exit(main(['report', {str(tmp_path)!r}]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert_one_line_error(out, "", "needs the rich package", "pip install 'monitored_optim[report]'")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ReportError, match=r"matplotlib package: pip install 'monitored_optim\[report\]'"):
        plot_run(load_run(tmp_path), tmp_path / "x.png")


def test_console_script_is_declared():
    (script,) = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == "monitored-optim"]
    assert script.value == "monitored_optim.__main__:main"


# ---- at scale: 6, 50, 300 and 2,000 tensors ------------------------------------------------------

def scaled_run(tmp_path: Path, layers: int, steps: int = 6) -> Path:
    """A real run of ``layers`` linear layers (2 tensors each) with named depth, random grads."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(layers)])
    opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-2, monitor=MonitorConfig(
        backend="jsonl", logdir=tmp_path / f"run{layers}"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    opt.monitor.close()
    return tmp_path / f"run{layers}"


@pytest.mark.parametrize("layers", [3, 25, 150, 1000], ids=["6", "50", "300", "2000"])
def test_report_table_heatmap_and_plot_at_scale(layers, tmp_path):
    from monitored_optim.report import plot_heatmap

    run_dir = scaled_run(tmp_path, layers)
    out = cli("report", str(run_dir), "--plot", "lines.png", "--heatmap", "heat.png", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    rows = [line for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == 2 * layers and all(line.rstrip().endswith("vector") for line in rows if ".bias" in line)
    run = load_run(run_dir)
    assert run.kinds["0.weight"] == "matrix" and run.kinds["0.bias"] == "vector"  # from params.json
    heat = image.imread(tmp_path / "heat.png")
    assert heat.shape[1] >= 800 and 400 <= heat.shape[0] <= 16 * 110 + 200
    from matplotlib import colormaps

    low_end = np.array(colormaps["RdBu_r"](0.0)[:3])  # the bar's bottom (log10 ratio -5); no cell is that low here
    assert (np.abs(heat[..., :3] - low_end).max(-1) < 0.06).sum() > 50  # the colour bar is drawn (a tick
    # outside its range once left it blank)
    assert_real_png(tmp_path / "lines.png")
    figure = plot_heatmap(run, tmp_path / "again.png")
    assert figure.exists()


def test_plot_params_glob_and_a_glob_that_matches_nothing(tmp_path):
    run_dir = scaled_run(tmp_path, 25)
    run = load_run(run_dir)
    assert_real_png(plot_run(run, tmp_path / "three.png", params="1?.weight"))
    with pytest.raises(ReportError, match="matches no parameter"):
        plot_run(run, tmp_path / "none.png", params="layers.*")


def test_shorten_keeps_the_layer_index_and_the_end():
    from monitored_optim.report import shorten

    assert shorten("transformer.h.11.attn.c_attn.weight", 26) == "tran…11.attn.c_attn.weight"
    name = "transformer.h.11.attn.c_attn.weight"
    for width in (12, 20, 26, 34):
        short = shorten(name, width)
        assert len(short) <= width and "11" in short and short.endswith("weight"), short
    assert shorten("fc1.weight", 20) == "fc1.weight"


def test_a_wandb_only_run_directory_says_where_its_figures_are(tmp_path):
    (tmp_path / "wandb").mkdir()
    with pytest.raises(ReportError, match="it holds a W&B run.*MONITORED_OPTIM_BACKEND=wandb,jsonl"):
        load_run(tmp_path)


def test_a_logdir_shared_with_a_trainers_logger(tmp_path):
    """Lightning's ``TensorBoardLogger`` (or any ``SummaryWriter``) writing its loss into the
    monitor's logdir at other steps: the report's steps are the monitor's, every latest value is
    there, nothing of rich's markup leaks into the text and the title is one line at 80 columns."""
    from tensorboardX import SummaryWriter

    run = tmp_path / "lit" / "version_0"
    latest = train("tensorboard", run, steps=20, every=5)
    writer = SummaryWriter(str(run))
    for step in [4, 9, 14, 19, 63, 127]:
        writer.add_scalar("train_loss", 1.0 / (step + 1), step)
    writer.close()
    assert load_run(run).steps == [5, 10, 15, 20]
    out = cli("report", "lit/version_0", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "lit/version_0  (tensorboard, 4 logged steps, last step 20)", lines[:2]
    title = cli("report", str(run), cwd=tmp_path).stdout.splitlines()[0]  # a long path: its start gives way
    assert title.startswith("…") and title.endswith("/lit/version_0  (tensorboard, 4 logged steps, last step 20)")
    assert len(title) == 80, title
    assert "[" not in out.stdout.replace("[-4, -2]", ""), out.stdout
    assert f"global/grad_norm {latest['global/grad_norm']:.3g}" in out.stdout
    line = next(line for line in lines if " fc1.weight " in line)
    assert f"{latest['update_to_data/fc1.weight']:.2f}" in line
    assert max(map(len, lines)) <= 80
    parent = cli("report", ".", cwd=tmp_path)  # two levels above the run
    assert parent.returncode == 1 and "runs found in subdirectories: lit/version_0;" in parent.stderr, parent.stderr


def test_a_logdir_with_only_another_writers_tags_fails_with_one_line(tmp_path, capsys):
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(5):
        writer.add_scalar("train/loss", 1.0 / (step + 1), step)
    writer.close()
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no monitored_optim figures" in err and "'train/loss'" in err, err


def test_a_tensorboard_run_over_the_tag_budget_reads_as_depth_groups(tmp_path):
    """TensorBoard got each group's min, median, max, argmin and argmax over depth: the report shows
    one row per group from its median (the layer indices are no ratios), equal to the median of the
    per-layer figures that ``metrics.jsonl`` kept."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(8)])
    opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-2, monitor=MonitorConfig(
        backend="tensorboard,jsonl", logdir=tmp_path / "run", tag_budget=70))  # 8 layers: 90 tags, 60 grouped
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    opt.monitor.close()
    (tmp_path / "run" / "metrics.jsonl").rename(tmp_path / "kept.jsonl")
    run = load_run(tmp_path / "run")
    assert [p.name for p in parameters(run)] == ["*.weight", "*.bias"]
    assert rows_noun(parameters(run)) == "depth groups"  # the plots' titles
    last = json.loads((tmp_path / "kept.jsonl").read_text().splitlines()[-1])
    median = statistics.median(last[f"update_to_data/{i}.weight"] for i in range(8))
    assert run.values("update_to_data/*.weight")[4] == pytest.approx(median, rel=1e-6)
    out = cli("report", "run", cwd=tmp_path)
    assert out.returncode == 0 and "argmin" not in out.stdout and " *.weight " in out.stdout, out.stdout


@pytest.mark.parametrize("names,noun", [(["fc1.weight", "fc1.bias"], "parameters"),
                                        (["*.weight", "*.bias"], "depth groups"),
                                        (["embed.weight", "h.*.weight"], "parameters and depth groups")])
def test_plot_titles_name_depth_groups_as_such(names, noun):
    assert rows_noun([Param("", n) for n in names]) == noun

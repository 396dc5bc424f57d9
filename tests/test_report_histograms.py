"""The report's picture of the update histograms: ``histograms.jsonl`` read back bin for bin, the image
written, and a run without the file or with a damaged one answered with one line and exit status 1."""

from __future__ import annotations

import pytest

from monitored_optim.__main__ import main
from monitored_optim.backends.jsonl import JsonlBackend
from monitored_optim.report import load_histograms
from test_histogram_sinks import send, training


@pytest.fixture
def run_dir(tmp_path):
    steps = training(3)
    send(("jsonl",), tmp_path / "run", steps)
    return tmp_path / "run", steps


def report(capsys, *args: str) -> tuple[int, str, list[str]]:
    code = main(["report", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def test_histograms_read_back_bin_for_bin_and_draw(run_dir, capsys, tmp_path):
    path, steps = run_dir
    read = load_histograms(path)
    assert read.steps == [1, 2, 3]
    assert {tag: points for tag, points in read.counts.items()} == {
        tag: {step: hists[tag] for step, _, hists in steps} for tag in steps[0][2]}
    code, out, err = report(capsys, path, "--histograms", tmp_path / "h.png", "--params", "h.*")
    assert (code, err) == (0, []) and f"histograms written to {tmp_path / 'h.png'}" in out
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cut_last_line_is_skipped_and_a_restart_replaces_the_later_steps(run_dir):
    path, steps = run_dir
    with open(path / "histograms.jsonl", "a") as file:
        file.write('{"step": 2, "edges": [-65536.0')
    backend = JsonlBackend(path)  # a restart from step 1 appended to the file (an optimizer that loads an
    for step, _, hists in training(1):  # earlier checkpoint as it logs, or a file older than runs kept apart)
        backend.histograms(hists, step)
    backend.close()
    read = load_histograms(path)
    assert read.steps == [1] and read.counts["update_hist/h.0.weight"][1] == training(1)[0][2]["update_hist/h.0.weight"]


@pytest.mark.parametrize("damage, words", [
    (None, "histograms.jsonl: no such file; histograms are written there by the jsonl backend"),
    ("garbage\n", "histograms.jsonl:4: corrupt line"),
    ('{"step": 9, "edges": [1.0]}\n', 'histograms.jsonl:4: corrupt line ("edges" are not the 114 fixed edges'),
    ('{"step": 9, "edges": EDGES, "update_hist/a": {"start": 114, "counts": [1, 2]}}\n', "not {\"start\": bin"),
    ('{"step": 9, "edges": EDGES, "update_hist/a": {"start": 3, "counts": [-1]}}\n', "not {\"start\": bin"),
])
def test_a_missing_or_damaged_file_is_one_line_and_status_1(run_dir, capsys, tmp_path, damage, words):
    path, _ = run_dir
    file = path / "histograms.jsonl"
    if damage is None:
        file.unlink()
    else:
        from monitored_optim.histograms import EDGES

        with open(file, "a") as out:
            out.write(damage.replace("EDGES", str(list(EDGES))))
    code, _, err = report(capsys, path, "--histograms", tmp_path / "h.png")
    assert code == 1 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "h.png").exists()


def test_params_that_match_no_layer_is_one_line(run_dir, capsys, tmp_path):
    code, _, err = report(capsys, run_dir[0], "--histograms", tmp_path / "h.png", "--params", "nothing*")
    assert code == 1 and len(err) == 1 and "--params 'nothing*' matches no layer with an update histogram" in err[0]


def test_the_default_picture_shows_a_frozen_matrix(tmp_path):
    """A monitored run where one matrix never moves (its group's lr is 0: no update-to-data ratio, so
    the line plot's choice misses it) among eight that learn: the picture's default layers include
    it, and the others drawn are matrices too."""
    import torch
    from torch import nn

    from monitored_optim import Monitored, MonitorConfig
    from monitored_optim.report import load_run
    from monitored_optim.report.histograms import HANDFUL, layers

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)], nn.Linear(4, 4))
    named = list(net.named_parameters())
    groups = [{"params": [p for n, p in named if not n.startswith("8.")], "param_names": [n for n, _ in named
                                                                                       if not n.startswith("8.")]},
              {"params": [p for n, p in named if n.startswith("8.")], "param_names": ["8.weight", "8.bias"], "lr": 0.0}]
    opt = Monitored(torch.optim.SGD)(groups, lr=0.1, monitor=MonitorConfig(
        backend="jsonl", logdir=tmp_path, every=1, figures="default,histograms"))
    with pytest.warns(RuntimeWarning, match="'8.weight' has a gradient but has not changed"):
        for _ in range(3):
            opt.zero_grad()
            net(torch.randn(4, 4)).square().mean().backward()
            opt.step()
    opt.monitor.close()
    chosen = [p.label for p in layers(load_histograms(tmp_path), load_run(tmp_path))]
    assert "8.weight" in chosen and len(chosen) == HANDFUL and all(c.endswith(".weight") for c in chosen), chosen

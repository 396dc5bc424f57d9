"""The documentation site builds without a warning, and every Python block of every page runs.

The build is nitpicky (``-n``): an API reference, a page link or a heading anchor that does not
resolve fails it, as does any docstring that Sphinx cannot read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from snippets import ROOT, pages, python_blocks

BLOCKS = [(page, i, code) for page in pages() for i, code in enumerate(python_blocks(page))]


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    pytest.importorskip("furo")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
                           str(ROOT / "docs"), str(tmp_path / "html")], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    assert (tmp_path / "html" / "index.html").is_file()
    assert (tmp_path / "html" / "reference" / "api.html").read_text().count("monitored_optim.monitored.Monitored") > 0


def test_the_pages_hold_python_blocks():
    names = {page.relative_to(ROOT).as_posix() for page, _, _ in BLOCKS}
    assert {"README.md", "docs/guides/trainers.md", "docs/guides/your-optimizer.md"} <= names, names


def _trainer_objects(tmp_path) -> dict:
    """A tiny GPT-2, TrainingArguments, a dataset, a loader and an accelerate Accelerator on the CPU."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    return {"model": model, "args": args, "transformers": transformers,
            "train": [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(4)],
            "loader": torch.utils.data.DataLoader(torch.randn(8, 16), batch_size=4),
            "decay": [p for p in model.parameters() if p.dim() >= 2],
            "no_decay": [p for p in model.parameters() if p.dim() < 2],
            "accelerator": accelerate.Accelerator(cpu=True)}


def namespace(code: str, tmp_path) -> dict:
    """The objects a block's text presumes: a model, a loader and a loss, or a Trainer's arguments."""
    from monitored_optim import Monitored, MonitorConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    names = {"torch": torch, "Monitored": Monitored, "MonitorConfig": MonitorConfig, "model": model,
             "loader": [(torch.randn(16, 4), torch.randn(16, 2)) for _ in range(5)],
             "loss_fn": torch.nn.functional.mse_loss}
    if re.search(r"\b(transformers|accelerator|args|train|decay|no_decay)\b", code):
        names.update(_trainer_objects(tmp_path))
    if re.search(r"\blightning\.", code):
        names["lightning"] = pytest.importorskip("lightning")
    return names


@pytest.mark.parametrize("page, index, code", BLOCKS,
                         ids=[f"{page.relative_to(ROOT).as_posix()}#{i}" for page, i, _ in BLOCKS])
def test_every_python_block_runs_without_a_warning_of_ours(page, index, code, tmp_path, monkeypatch, request):
    monkeypatch.setenv("MONITORED_OPTIM_BACKEND", "jsonl")
    monkeypatch.setenv("MONITORED_OPTIM_LOGDIR", str(tmp_path / "runs"))
    if re.search(r"^import ray\b", code, flags=re.M):
        request.getfixturevalue("ray_cluster")  # Ray Train's workers: a cluster of two CPUs, skipped without ray
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        exec(compile(code, f"{page.name}#{index}", "exec"), namespace(code, tmp_path))
    ours = [str(w.message) for w in seen if str(w.message).startswith("monitored_optim")]
    assert not ours, ours

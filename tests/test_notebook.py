"""``examples/makemore.ipynb`` executed top to bottom by a real Jupyter kernel (``nbclient`` and
``ipykernel``): it trains, and its outputs hold the update-to-data plot as an image, the report
table as HTML and the history as a DataFrame."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("pandas")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "makemore.ipynb"


def outputs(cell) -> dict[str, str]:
    """MIME type -> content of a code cell's displayed results (and ``stream`` -> its printed text)."""
    out: dict[str, str] = {}
    for output in cell.outputs:
        if output.output_type == "stream":
            out["stream"] = out.get("stream", "") + output.text
        else:
            out.update(output.get("data", {}))
    return out


def test_makemore_notebook_trains_and_shows_the_plot_and_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel's torch: small ops, a shared machine
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(NOTEBOOK.parents[1]), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []  # what the committed copy shows plays no part
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    cells = {cell.source.splitlines()[0]: outputs(cell) for cell in notebook.cells if cell.cell_type == "code"}
    assert not any("error" == o.output_type for c in notebook.cells if c.cell_type == "code" for o in c.outputs)

    training = cells["torch.manual_seed(0)"]["stream"].splitlines()
    first, last = (float(line.split("loss")[1]) for line in (training[0], training[-1]))
    assert training[-1].startswith("step  3000") and last < first - 0.8, training

    plot = cells["opt.monitor.plot()"]
    png = base64.b64decode(plot["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    assert "Figure" in plot["text/plain"]

    table = cells["opt.monitor.report()"]["text/html"]
    assert table.startswith("<pre")
    for name in ("emb.weight", "fc1.weight", "fc2.weight", "fc3.weight", "bn1.weight", "out.weight", "out.bias"):
        assert name in table, name
    assert "u/d" in table and "health, latest" in table and "no_grad" in table

    frame = cells["history = opt.monitor.history()"]["text/html"]
    assert "<table" in frame and "update_to_data/fc1.weight" in frame and "<th>3000</th>" in frame
    assert not (tmp_path / "runs").exists()  # backend="none": nothing written

"""torch.compile(opt.step): a non-logging step compiles to the plain optimizer's graphs with no graph
break of its own; a logging step runs its capture outside the compiled graphs and stays exact, and
the trajectory is the plain compiled optimizer's, bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import truth
from monitored_optim import Monitored, MonitorConfig


def compiled_run(monitor: MonitorConfig | None, steps: int = 6, check=None):
    """Compile ``opt.step`` of AdamW over a small MLP and run ``steps`` steps; returns the model, the
    optimizer and Dynamo's counts (unique graphs, graph breaks)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if monitor is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-2, weight_decay=0.1, monitor=monitor)
    step = torch.compile(opt.step)
    gen = torch.Generator().manual_seed(1)
    named = list(model.named_parameters())
    for i in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        before, grads = truth.snapshot(named)
        step()
        if check is not None and monitor is not None and (i + 1) % monitor.every == 0:
            check(opt.monitor.latest, truth.figures(named, before, grads))
    return model, opt, (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


@pytest.mark.parametrize("every", [1000, 3], ids=["no-logging-step", "every-3"])
def test_compiled_step_has_the_plain_graphs_and_trajectory(every, tmp_path):
    plain_model, plain, plain_counts = compiled_run(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, counts = compiled_run(MonitorConfig(backend="none", every=every, logdir=tmp_path),
                                          check=truth.assert_figures_match)
    assert counts == plain_counts, (counts, plain_counts)
    assert not [w for w in caught if "monitored_optim" in str(w.filename) or "monitor.py" in str(w.message)]
    for a, b in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for sa, sb in zip(plain.state.values(), opt.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert opt.monitor.step == 6
    print(f"every={every}: unique graphs {counts[0]}, graph breaks {counts[1]} (plain: {plain_counts})")

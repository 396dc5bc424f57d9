"""The monitor's own cost as figures (``monitor/copied_bytes``, ``monitor/host_seconds``) and
``describe()`` after a logging step: the route each parameter took there."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from monitored_optim import Monitored, MonitorConfig
from tests.thirdparty import SignSGD


def _stepped(opt, named, steps=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    return opt.monitor.latest


def _bytes(named):
    return sum(p.numel() * p.element_size() for _, p in named)


def test_a_clone_fallback_copies_exactly_the_parameter_bytes(tmp_path):
    named = [("w", nn.Parameter(torch.randn(64, 100))), ("b", nn.Parameter(torch.zeros(64)))]
    opt = Monitored(SignSGD)(named, lr=1e-3, monitor=MonitorConfig(backend="none", every=2, logdir=tmp_path))
    latest = _stepped(opt, named)
    assert latest["monitor/copied_bytes"] == _bytes(named) == (64 * 100 + 64) * 4
    assert 0 < latest["monitor/host_seconds"] < 60


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "fused"])
def test_adamw_views_copy_nothing_of_large_float32_matrices(compile, tmp_path):
    named = [("a", nn.Parameter(torch.randn(256, 300) * 0.02)), ("b", nn.Parameter(torch.randn(300, 256) * 0.02))]
    opt = Monitored(torch.optim.AdamW)(named, lr=1e-3, monitor=MonitorConfig(backend="none", every=1, compile=compile,
                                                                              logdir=tmp_path))
    for _ in range(3):
        assert _stepped(opt, named, steps=1)["monitor/copied_bytes"] == 0


def test_a_bf16_matrix_snapshot_and_the_flat_chunk_copy_their_bytes(tmp_path):
    low = [("low", nn.Parameter(torch.randn(128, 64).to(torch.bfloat16)))]
    small = [("s.weight", nn.Parameter(torch.randn(10, 20))), ("s.bias", nn.Parameter(torch.zeros(10)))]
    opt = Monitored(torch.optim.AdamW)(low, lr=1e-3, monitor=MonitorConfig(backend="none", every=1, logdir=tmp_path))
    assert _stepped(opt, low, steps=1)["monitor/copied_bytes"] == 128 * 64 * 2  # snapshot (low precision)
    opt = Monitored(torch.optim.AdamW)(small, lr=1e-3, monitor=MonitorConfig(backend="none", every=1,
                                                                              logdir=tmp_path / "s"))
    assert "copied flat" in opt.monitor.describe()
    assert _stepped(opt, small, steps=1)["monitor/copied_bytes"] == (200 + 10) * 4  # one flat buffer


def test_the_cost_is_in_the_jsonl_and_left_out_by_the_figure_selection(tmp_path):
    for figures, logdir in ((None, tmp_path / "all"), ("update_to_data", tmp_path / "u")):
        named = [("w", nn.Parameter(torch.randn(32, 32)))]
        opt = Monitored(SignSGD)(named, lr=1e-3, monitor=MonitorConfig(backend="jsonl", every=2, figures=figures,
                                                                        logdir=logdir))
        _stepped(opt, named, steps=4)
        opt.monitor.close()
        rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [2, 4]
        tags = {tag for row in rows for tag in row if tag.startswith("monitor/")}
        assert tags == (set() if figures else {"monitor/copied_bytes", "monitor/host_seconds"}), rows
        if not figures:
            assert all(row["monitor/copied_bytes"] == 32 * 32 * 4 for row in rows)


def _row(text, name):
    return next(line for line in text.splitlines() if line.split()[:1] == [name])


def test_describe_shows_the_plan_before_any_step_and_the_route_taken_after(tmp_path):
    named = [("w", nn.Parameter(torch.randn(64, 100))), ("b", nn.Parameter(torch.zeros(64)))]
    opt = Monitored(SignSGD)(named, lr=1e-3, monitor=MonitorConfig(backend="none", every=2, logdir=tmp_path))
    before = opt.monitor.describe()
    assert "capture: the plan, before any logging step" in before and "took at step" not in before
    _stepped(opt, named, steps=3)  # logs at step 2
    after = opt.monitor.describe()
    assert "the route each parameter took at step 2" in after and "the plan, before" not in after
    assert _row(after, "w").endswith("clone (no state-aware view for this optimizer's step)"), after


def test_describe_names_the_schedule_free_replayed_sums_fallback_where_it_happens(tmp_path):
    schedulefree = pytest.importorskip("schedulefree")
    gen = torch.Generator().manual_seed(0)
    named = [("w", nn.Parameter(torch.randn(128, 64, generator=gen)))]  # updates of a few spacings
    opt = Monitored(schedulefree.SGDScheduleFree)(named, lr=1e-3, monitor=MonitorConfig(backend="none", every=1,
                                                                                          logdir=tmp_path))
    opt.train()
    assert _row(opt.monitor.describe(), "w").endswith("view (SGDScheduleFreeView)")
    seen = []
    for _ in range(4):
        assert _stepped(opt, named, steps=1)["monitor/copied_bytes"] == 0  # the replay keeps three sums, no copy
        seen.append(_row(opt.monitor.describe(), "w"))
    assert any("replayed sums" in row and "fell back" in row for row in seen), seen
    assert all(row.endswith("view (SGDScheduleFreeView)") or "replayed sums" in row for row in seen), seen


def test_the_last_record_holds_no_tensor_of_its_step(tmp_path):
    """After a logging step its record (what ``describe()`` and the monitor family read) does not keep
    the step's batch of sums alive, nor the part-sized buffers of its workspace."""
    named = [("w", nn.Parameter(torch.randn(64, 100)))]
    opt = Monitored(torch.optim.SGD)(named, lr=1e-3, monitor=MonitorConfig(backend="none", every=1, logdir=tmp_path))
    _stepped(opt, named, steps=1)
    assert opt.monitor._engine.capture.spent.last.key() is None


@pytest.mark.parametrize("at", ["start", "end"])
def test_an_interrupt_in_a_stage_reaches_the_caller_and_leaves_the_collector_on(at, monkeypatch, tmp_path):
    """A Ctrl-C that Python raises in a logging stage's own bookkeeping, at its start (just after the
    stage paused the cyclic garbage collector) or at its end (a signal is handled at whichever bytecode
    comes next), reaches training, and the collector runs again: it is paused for the stage only."""
    import gc
    import time
    import types

    from monitored_optim.capture import spent

    named = [("w", nn.Parameter(torch.randn(8, 4)))]
    opt = Monitored(torch.optim.SGD)(named, lr=1e-3, monitor=MonitorConfig(backend="none", every=1, logdir=tmp_path))
    calls = []

    def perf_counter():  # the first stage's first call is its start, its second its end
        calls.append(gc.isenabled())
        if len(calls) == (1 if at == "start" else 2):
            raise KeyboardInterrupt
        return time.perf_counter()

    monkeypatch.setattr(spent, "time", types.SimpleNamespace(perf_counter=perf_counter))
    assert gc.isenabled()
    with pytest.raises(KeyboardInterrupt):
        _stepped(opt, named, steps=1)
    resumed = gc.isenabled()
    gc.enable()  # for the tests after this one, whatever it found
    assert calls[0] is False  # the stage had paused the collector
    assert resumed

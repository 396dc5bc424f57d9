"""The guard, alerts and stopping on 2 gloo ranks: a NaN in one rank's grad (DDP) or shard (FSDP2)
only. Every rank skips the same step, bit for bit the twin that never took it; one alert, from the
writing rank; ``should_stop`` on every rank at the same step."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from monitored_optim import Monitored, MonitorConfig
from test_distributed import OPT, launch, loss_of, model

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

STEPS, POISONED = 6, (3, 4)
"""Rank 1 alone gets a NaN at steps 3 and 4; the budget of 1 makes the second skip ask to stop."""


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def guarded_run(rank: int, world: int, wrap, **config) -> dict:
    """Train a guarded monitored model and its plain twin (which skips the poisoned steps) on this rank's
    half of each batch; return what the rank saw."""
    records = Records()
    logging.getLogger("monitored_optim.alerts").addHandler(records)
    net, twin = wrap(model()), wrap(model())
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=MonitorConfig(
        **{"backend": "none", "every": 2, "guard": "nonfinite", "skip_budget": 1, "alerts": "skipped", **config}))
    plain = torch.optim.AdamW(twin.parameters(), **OPT)
    skipped, stops = [], []
    for step in range(1, STEPS + 1):
        for m, o in ((net, opt), (twin, plain)):
            o.zero_grad()
            loss_of(m, step, rank, world).backward()
        if rank == 1 and step in POISONED:
            grad = next(p.grad for p in net.parameters() if p.grad is not None and _local(p.grad).numel())
            _local(grad).view(-1)[0] = math.nan
        opt.step()
        skipped.append(opt.monitor.step_was_skipped)
        stops.append(opt.monitor.should_stop)
        if step not in POISONED:
            plain.step()
    same = all(torch.equal(_local(a), _local(b)) for a, b in zip(net.parameters(), twin.parameters()))
    state = len(opt.state) == len(plain.state) > 0 and all(
        torch.equal(_local(x), _local(y)) for sa, sb in zip(opt.state.values(), plain.state.values())
        for x, y in zip(sa.values(), sb.values()))
    return {"skipped": skipped, "stops": stops, "same": same, "state": state, "alerts": records.messages,
            "guard/skipped": opt.monitor.latest.get("guard/skipped")}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _ddp(rank, world, outdir):
    return guarded_run(rank, world, DDP)


def _fsdp2(rank, world, outdir):
    def shard(net):
        for name in ("fc1", "fc2", "norm", "head"):
            fully_shard(getattr(net, name))
        return fully_shard(net)
    return guarded_run(rank, world, shard)


@pytest.mark.parametrize("fn", [_ddp, _fsdp2], ids=["DDP", "FSDP2"])
def test_a_nan_on_one_rank_is_skipped_by_every_rank(fn, tmp_path):
    results = launch(fn, 2, tmp_path)
    want = [step in POISONED for step in range(1, STEPS + 1)]
    for rank, r in enumerate(results):
        assert r["skipped"] == want, rank
        assert r["stops"] == [False, False, False, True, True, True], rank
        assert r["same"] and r["state"], rank
        assert r["guard/skipped"] == 2.0, rank
    assert len(results[0]["alerts"]) == 1 and "skipped at step 3" in results[0]["alerts"][0]
    assert "on another rank" in results[0]["alerts"][0]  # rank 0's own grads were finite
    assert results[1]["alerts"] == []  # one voice: the writing rank's


def _spike(rank, world, outdir):
    """DDP without the guard, a 1e4x grad on every rank's copy of one layer at step 10: the spike is
    warned about (and told as an event) by the writing rank alone, and counted on both."""
    import warnings

    records = Records()
    logging.getLogger("monitored_optim.alerts").addHandler(records)
    net = DDP(model())
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=MonitorConfig(
        backend="none", every=1, alerts="spikes", stop_on="spikes"))
    spikes, stops = [], []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(1, 13):
            opt.zero_grad()
            loss_of(net, step, rank, world).backward()
            if step == 10:
                net.module.fc2.weight.grad.mul_(1e4)
            opt.step()
            spikes.append(opt.monitor.latest["health/spikes"])
            stops.append(opt.monitor.should_stop)
    told = [str(w.message) for w in seen if "spike at step" in str(w.message)]
    return {"told": told, "spikes": spikes, "stops": stops, "alerts": records.messages}


def _ddp_stop_on_nonfinite(rank, world, outdir):
    return guarded_run(rank, world, DDP, alerts="nonfinite", stop_on="nonfinite", skip_budget=5)


def test_a_nan_only_one_rank_sees_stops_every_rank_and_is_told_by_the_writer(tmp_path):
    """stop_on and alerts on the guard's nonfinite event follow the verdict every rank shares: rank 1's
    NaN stops both ranks at step 3, and rank 0, which writes, tells it (naming another rank)."""
    results = launch(_ddp_stop_on_nonfinite, 2, tmp_path)
    for rank, r in enumerate(results):
        assert r["stops"] == [False, False, True, True, True, True], rank
        assert r["same"] and r["state"], rank
    assert len(results[0]["alerts"]) == 1 and "nonfinite at step 3" in results[0]["alerts"][0]
    assert "a grad on another rank" in results[0]["alerts"][0]
    assert results[1]["alerts"] == []


def test_a_spike_under_ddp_is_told_once_by_the_writing_rank(tmp_path):
    results = launch(_spike, 2, tmp_path)
    for r in results:
        assert r["spikes"][9] >= 1.0 and sum(r["spikes"][:9]) == 0
        assert r["stops"] == [False] * 9 + [True] * 3  # every rank stops at the same step
    assert len(results[0]["told"]) == 1 and "fc2.weight" in results[0]["told"][0]
    assert results[1]["told"] == []
    assert len(results[0]["alerts"]) == 1 and results[1]["alerts"] == []

"""Pipeline stages (``torch.distributed.pipelining``) on CPU/gloo: every rank monitors only its stage's
parameters, and every rank's figures cover every stage's, under the model's full names, equal to
the clone truth of the rank that holds each parameter; global norms over the whole model; one
collective per logging step inside ``opt.step()`` (two more for the names' exchange at the first).

Layouts: two stages alone (2 processes); two stages x two data-parallel replicas (grads averaged
over the replicas) and two stages x FSDP2 over the data-parallel dimension of a (2, 2) mesh (4
processes).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from monitored_optim import Monitored, MonitorConfig
from test_distributed import EXCHANGE, CountCollectives, histogram_of, launch
from test_histograms import assert_all_exact, spacing

STEPS, EVERY, BATCH, LAYERS = 4, 2, 8, 4
RATIO_TOL, NORM_RTOL = 2e-3, 1e-4
STAGE_LAYERS = [["0", "1"], ["2", "3"]]


class Net(nn.Module):
    """A stack of layers under full names (``layers.2.weight``); a stage keeps only its own layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({"0": nn.Linear(8, 16), "1": nn.LayerNorm(16), "2": nn.Linear(16, 16),
                                     "3": nn.Linear(16, 4)})
        for name in ("0", "2", "3"):
            nn.init.zeros_(self.layers[name].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def stage_module(index: int) -> Net:
    net = Net()
    for name in list(net.layers):
        if name not in STAGE_LAYERS[index]:
            del net.layers[name]
    return net


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().clone()


def _run(rank, world, outdir, dp: str | None):
    """The monitored run (:func:`_train`) and the same run on the plain optimizer."""
    out = _train(rank, dp, monitored=True)
    out["plain"] = _train(rank, dp, monitored=False)["final"]
    return out


def _train(rank, dp: str | None, monitored: bool):
    """Train STEPS steps; return this rank's latest figures at logging steps, the clone truth of its
    own parameters, the collectives inside ``opt.step()`` and its parameters at the end."""
    if dp is None:
        pp_group, stage_index, replica, replicas = dist.group.WORLD, rank, 0, 1
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp_group, stage_index = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
        replica, replicas = mesh["dp"].get_local_rank(), 2
    module = stage_module(stage_index)
    if dp == "fsdp2":
        fully_shard(module, mesh=mesh["dp"])
    stage = PipelineStage(module, stage_index, 2, torch.device("cpu"), group=pp_group)
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean())
    named = list(module.named_parameters())
    extra = {"monitor": MonitorConfig(backend="none", every=EVERY, figures="default,histograms")} if monitored else {}
    opt = (Monitored(torch.optim.AdamW) if monitored else torch.optim.AdamW)(named, lr=1e-2, weight_decay=0.1,
                                                                             **extra)
    latest, hists, truth, counts = {}, {}, {}, []
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
        part = slice(replica * BATCH // replicas, (replica + 1) * BATCH // replicas)
        opt.zero_grad()
        if stage_index == 0:
            schedule.step(x[part])
        else:
            schedule.step(target=y[part])
        if dp == "replicas":
            for _, p in named:
                dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                p.grad /= replicas
        if step % EVERY == 0:
            before = {n: full(p) for n, p in named}
            grads = {n: full(p.grad) for n, p in named}
        with CountCollectives() as c:
            opt.step()
        counts.append(c.ops)
        if step % EVERY == 0 and monitored:
            latest[step] = dict(opt.monitor.latest)
            hists[step] = dict(opt.monitor.histograms)
            truth[step] = {n: (before[n], grads[n], full(p)) for n, p in named}
    return {"latest": latest, "hists": hists, "truth": truth, "counts": counts,
            "final": {n: full(p) for n, p in named}}


def figures(truth: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    out, sq = {}, {"update": 0.0, "grad": 0.0, "param": 0.0}
    for name, (p, g, after) in truth.items():
        u = after - p
        out[f"update_norm/{name}"], out[f"param_norm/{name}"], out[f"grad_norm/{name}"] = \
            u.norm().item(), p.norm().item(), g.norm().item()
        out[f"update_to_data/{name}"] = math.log10(u.std().item() / p.std().item())
        out[f"grad_to_data/{name}"] = math.log10(g.std().item() / p.std().item())
        for kind, t in (("update", u), ("grad", g), ("param", p)):
            sq[kind] += t.square().sum().item()
    out.update({f"global/{kind}_norm": math.sqrt(v) for kind, v in sq.items()})
    return out


@pytest.mark.parametrize("dp,world", [(None, 2), ("replicas", 4), ("fsdp2", 4)],
                         ids=["stages", "stages x replicas", "stages x fsdp2"])
def test_every_rank_gets_every_stage_figures_equal_to_the_clone_truth(dp, world, tmp_path):
    results = launch(lambda r, w, o: _run(r, w, o, dp), world, tmp_path, deadline=300.0)
    names = {f"layers.{layer}.{kind}" for stage in STAGE_LAYERS for layer in stage for kind in ("weight", "bias")}
    for step in range(EVERY, STEPS + 1, EVERY):
        truth = {}
        for res in results:
            truth.update(res["truth"][step])  # a replica's truth is the same parameter's
        assert set(truth) == names
        want = figures(truth)
        counted = {f"{series}/{n}": histogram_of(t) for n, (p, g, after) in truth.items()
                   for series, t in (("update_hist", after - p), ("grad_hist", g), ("param_hist", after))}
        for rank, res in enumerate(results):
            assert_all_exact(res["hists"][step], counted, {f"update_hist/{n}": spacing(after.float())  # u rebuilt
                                                          for n, (_, _, after) in truth.items()})  # from the state
            # is within a spacing of p: every stage's histograms, extremes too, on every rank
            got = res["latest"][step]
            assert got == results[0]["latest"][step], rank
            for tag, value in want.items():
                if "_to_data/" in tag:
                    assert abs(got[tag] - value) <= RATIO_TOL, (rank, step, tag, got[tag], value)
                else:
                    assert abs(got[tag] - value) <= NORM_RTOL * abs(value), (rank, step, tag, got[tag], value)
    for rank, res in enumerate(results):
        assert all(torch.equal(res["final"][n], value) for n, value in res["plain"].items()), rank  # bit for bit
        for step, ops in enumerate(res["counts"], start=1):
            if step % EVERY == 0:
                assert ops == (EXCHANGE if step == EVERY else []) + ["c10d.allreduce_.default"], (rank, step, ops)
            else:
                assert ops == [], (rank, step, ops)


def _own_names(rank, world, outdir):
    """Stages built each as a model of its own: both ranks monitor a ``0.weight`` and a ``0.bias``,
    of different shapes."""
    import warnings

    torch.manual_seed(rank)
    stage = nn.Sequential(nn.Linear(8, 16)) if rank == 0 else nn.Sequential(nn.Linear(16, 4))
    named = list(stage.named_parameters())
    opt = Monitored(torch.optim.AdamW)(named, lr=1e-2, monitor=MonitorConfig(backend="none", every=1))
    for _, p in named:
        p.grad = 0.1 * torch.randn_like(p)
    before = {n: full(p) for n, p in named}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    return {"latest": dict(opt.monitor.latest), "truth": {n: (before[n], full(p.grad), full(p)) for n, p in named},
            "warnings": [str(w.message) for w in seen if "monitored_optim" in str(w.message)]}


def test_stages_with_a_name_in_common_are_kept_apart(tmp_path):
    results = launch(_own_names, 2, tmp_path)
    want = {**figures(results[0]["truth"]),
            **{tag.replace(name, f"{name}@rank1"): v for name in ("0.weight", "0.bias")
               for tag, v in figures({name: results[1]["truth"][name]}).items() if not tag.startswith("global/")}}
    got = results[0]["latest"]
    assert results[1]["latest"] == got
    for tag in [t for t in want if not t.startswith("global/")]:
        assert abs(got[tag] - want[tag]) <= (RATIO_TOL if "_to_data/" in tag else NORM_RTOL * abs(want[tag])), tag
    assert len(results[0]["warnings"]) == 1 and "'0.weight', '0.weight@rank1' ([16, 8], [4, 16])" in \
        results[0]["warnings"][0], results[0]["warnings"]
    assert results[1]["warnings"] == []

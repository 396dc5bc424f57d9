"""Sharded and replicated training on CPU/gloo: the figures of every rank equal a single-process run
on the same data, each logging step issues exactly one collective (none otherwise), and only rank 0
writes.

Engines: DDP, FSDP2 ``fully_shard`` (uneven and empty shards), FSDP1 ``use_orig_params=True`` (empty
shards, no grad on them), ZeroRedundancyOptimizer wrapped as the monitored class and with a monitored
inner class, FSDP2 x tensor parallel on a (2, 2) mesh; Lightning Fabric's DDP strategy (the names).
Processes are forked (2, or 4 for the mesh), each test on its own free port, under a hard deadline: a
hang kills the processes and fails.
"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import pickle
import socket
import time
import traceback
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh  # imported once here, before the forks
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from monitored_optim import Monitored, MonitorConfig
from monitored_optim import distributed as mdist

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

STEPS, EVERY, BATCH = 4, 2, 16
"""Steps 1, 3 do not log; steps 2, 4 do."""
OPT = dict(lr=1e-2, weight_decay=0.1)
RATIO_TOL, NORM_RTOL = 2e-3, 1e-4
"""As tests/test_exactness.py for fp32: log10 ratios absolute, norms relative."""
COST = "monitor/"
"""The monitor's own cost (bytes copied, host seconds): not the model's figures, so not compared with
the single process's; summed in the collective, so the same on every rank (``check`` asserts it)."""
EXCHANGE = ["c10d.allgather_.default"] * 2
"""The one-off exchange of the monitored names at the first logging step (``all_gather_object``:
the sizes, then the names)."""
DEADLINE = 90.0
"""Seconds a test's processes may run in total before they are killed and the test fails."""


# ----- the model, the data and the single-process reference -------------------------------------

def model() -> nn.Module:
    """fc1 (6, 7) -> tanh -> fc2 (3, 6) -> tanh -> norm (3,) -> head (1, 3) + (1,). On 2 shards of dim
    0: fc2 and norm split 2/1, head 1/0 (an empty shard, the (1,) bias among them). The norm weight
    is near 1.0 with std 1e-4, the hard case for combining moments across ranks."""
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(fc1=nn.Linear(7, 6), act1=nn.Tanh(), fc2=nn.Linear(6, 3),
                                    act2=nn.Tanh(), norm=nn.LayerNorm(3), head=nn.Linear(3, 1)))
    with torch.no_grad():
        net.norm.weight.copy_(1.0 + 1e-4 * torch.randn(3))
        net.norm.bias.copy_(1e-2 * torch.randn(3))
    return net


def batch(step: int, part: int = 0, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's full batch of BATCH rows, or its ``part``-th of ``parts`` equal slices."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, 7, generator=g), torch.randn(BATCH, 1, generator=g)
    rows = slice(part * BATCH // parts, (part + 1) * BATCH // parts)
    return x[rows], y[rows]


def loss_of(net: nn.Module, step: int, part: int = 0, parts: int = 1) -> torch.Tensor:
    x, y = batch(step, part, parts)
    return (net(x) - y).pow(2).mean()


def reference(logdir, **settings) -> dict[int, dict[str, float]]:
    """The figures of a single-process run on the full batches, by logging step (``settings``: more
    MonitorConfig fields)."""
    net = model()
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=MonitorConfig(
        backend="none", every=EVERY, logdir=logdir, **settings))
    out = {}
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss_of(net, step).backward()
        opt.step()
        if step % EVERY == 0:
            out[step] = dict(opt.monitor.latest)
    return out


def assert_close_to_reference(got: dict[str, float], want: dict[str, float]) -> dict[str, float]:
    """Same tags (the plain model's names, whatever wraps it) and values within the fp32 tolerances;
    returns the errors (``{"ratio": max abs, "norm": max rel}``)."""
    got = {k: v for k, v in got.items() if not k.startswith(COST)}
    want = {k: v for k, v in want.items() if not k.startswith(COST)}
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    err = {"ratio": 0.0, "norm": 0.0}
    for tag, value in want.items():
        if "_to_data/" in tag:
            err["ratio"] = max(err["ratio"], abs(got[tag] - value))
            assert abs(got[tag] - value) <= RATIO_TOL, (tag, got[tag], value)
        elif "_norm" in tag:
            err["norm"] = max(err["norm"], abs(got[tag] - value) / max(abs(value), 1e-30))
            assert abs(got[tag] - value) <= NORM_RTOL * abs(value) + 1e-30, (tag, got[tag], value)
        else:  # lr/..., health/...: exact
            assert got[tag] == value, (tag, got[tag], value)
    return err


# ----- process harness ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world: int, port: int, outdir: str) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        built = fn.before_group(outdir) if hasattr(fn, "before_group") else None  # what a script builds first
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            result = fn(rank, world, outdir) if built is None else fn(rank, world, outdir, built)
        finally:
            dist.destroy_process_group()
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        code = 1
    finally:
        os._exit(code)  # no atexit handlers or pytest teardown in a forked child


def launch(fn, world: int, tmp_path, deadline: float = DEADLINE) -> list:
    """Run ``fn(rank, world, outdir)`` in ``world`` forked processes on a fresh gloo group; return the
    results by rank. Fails (after killing every process) past ``deadline`` seconds or on any error."""
    outdir = str(tmp_path)
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, outdir), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = {r: (tmp_path / f"rank{r}.err").read_text() for r in range(world) if (tmp_path / f"rank{r}.err").exists()}
    assert not errors, "\n".join(f"--- rank {r} ---\n{e}" for r, e in errors.items())
    assert not hung, f"ranks {hung} still running after {deadline} s (hang); killed"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world)]


class CountCollectives(TorchDispatchMode):
    """Counts c10d collectives (``c10d.*`` and functional ``_c10d_functional.*`` ops) dispatched
    while active: ``dist.all_reduce``, ``dist.broadcast``, DTensor redistributions alike."""

    NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")
    """Bookkeeping ops of functional collectives (the wait on, the wrapping of a result)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in func.namespace and func._opname not in self.NOT_COLLECTIVES:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def train(opt, net: nn.Module, part: int, parts: int, monitor_of=None) -> dict:
    """Run STEPS steps on this rank's slice of each batch; record per step the collectives issued
    inside ``opt.step()`` and, at logging steps, the monitor's latest figures."""
    monitor = (monitor_of or (lambda o: o.monitor))(opt)
    counts, latest = [], {}
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss_of(net, step, part, parts).backward()
        with CountCollectives() as c:
            opt.step()
        counts.append(c.ops)
        if step % EVERY == 0:
            latest[step] = dict(monitor.latest)
    return {"counts": counts, "latest": latest, "writer": mdist.is_writer(), "step": monitor.step}


def config(outdir: str) -> MonitorConfig:
    return MonitorConfig(backend="jsonl", every=EVERY, logdir=os.path.join(outdir, "logs"))


# ----- checks shared by every engine -------------------------------------------------------------

def check(results: list[dict], want: dict[int, dict[str, float]], tmp_path, plain_ops: int = 0) -> dict:
    """Figures equal on every rank and close to the reference; one collective per logging step,
    none otherwise (beyond ``plain_ops``, the engine's own inside step); one writer."""
    errors = {"ratio": 0.0, "norm": 0.0}
    for r, res in enumerate(results):
        assert res["step"] == STEPS
        assert res["latest"] == results[0]["latest"], f"rank {r} disagrees with rank 0"
        for step, figures in res["latest"].items():
            err = assert_close_to_reference(figures, want[step])
            errors = {k: max(errors[k], err[k]) for k in errors}
        for step, ops in enumerate(res["counts"], start=1):
            if step % EVERY:  # not logging: the engine's own collectives inside step(), if any
                assert len(ops) == plain_ops, (r, step, ops)
            else:  # logging: exactly one more, the all_reduce of the table (the first: after the names' exchange)
                gathers = [op for op in ops if op == EXCHANGE[0]]
                assert gathers == (EXCHANGE if step == EVERY else []), (r, step, ops)
                ops = [op for op in ops if op != EXCHANGE[0]]
                assert len(ops) == plain_ops + 1 and ops.count("c10d.allreduce_.default") == \
                    res["counts"][0].count("c10d.allreduce_.default") + 1, (r, step, ops)
    assert [res["writer"] for res in results] == [True] + [False] * (len(results) - 1)
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [s for s in range(1, STEPS + 1) if s % EVERY == 0]
    assert json.loads(lines[-1]) == {"step": STEPS, **results[0]["latest"][STEPS]}
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [".monitored_optim.lock", "metrics.jsonl",
                                                                      "params.json"]  # rank 0 alone writes
    return errors


@pytest.fixture(scope="module")
def want(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("reference"))


# ----- engines -----------------------------------------------------------------------------------

def _ddp(rank, world, outdir):
    net = DDP(model())
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=config(outdir))
    return train(opt, net, rank, world)


def test_ddp(tmp_path, want):
    results = launch(_ddp, 2, tmp_path)
    assert "update_to_data/fc1.weight" in results[0]["latest"][STEPS]  # DDP's module. is not in the names
    print("ddp", check(results, want, tmp_path))


def _ddp_built_first(rank, world, outdir, built):
    net, opt = built
    return train(opt, DDP(net), rank, world)


def _build_before_the_group(outdir):
    net = model()
    return net, Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=config(outdir))


_ddp_built_first.before_group = _build_before_the_group  # type: ignore[attr-defined]


def test_an_optimizer_built_before_the_process_group_writes_on_rank_0_alone(tmp_path, want):
    """Each rank builds the model and the monitored optimizer before ``init_process_group`` (where
    every process looks like a single one), then trains under DDP: the figures equal the single
    process's and rank 0 alone writes (``check``: the logdir's files, one line per logging step)."""
    results = launch(_ddp_built_first, 2, tmp_path)
    check(results, want, tmp_path)


def _fsdp2(rank, world, outdir):
    net = model()
    for name in ("fc1", "fc2", "norm", "head"):
        fully_shard(getattr(net, name))
    fully_shard(net)
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=config(outdir))
    shapes = {n: tuple(p.to_local().shape) for n, p in net.named_parameters()}
    result = train(opt, net, rank, world)
    return {**result, "shapes": shapes}


def test_fsdp2_fully_shard_uneven_and_empty_shards(tmp_path, want):
    results = launch(_fsdp2, 2, tmp_path)
    assert results[0]["shapes"]["fc2.weight"] == (2, 6) and results[1]["shapes"]["fc2.weight"] == (1, 6)
    assert results[0]["shapes"]["head.bias"] == (1,) and results[1]["shapes"]["head.bias"] == (0,)
    print("fsdp2", check(results, want, tmp_path))


def _fsdp1(rank, world, outdir):
    net = FSDP1(model(), use_orig_params=True, device_id=torch.device("cpu"),
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=config(outdir))
    result = train(opt, net, rank, world)
    return {**result, "numels": {n: p.numel() for n, p in net.named_parameters()}}


def test_fsdp1_use_orig_params(tmp_path, want):
    results = launch(_fsdp1, 2, tmp_path)
    assert 0 in results[0]["numels"].values() or 0 in results[1]["numels"].values()  # an empty shard
    print("fsdp1", check(results, want, tmp_path))


def _wrapped_names(rank, world, outdir):
    """One logging step of each wrapped model, its parameters given as the wrapper's
    ``named_parameters()`` or bare with the wrapper as ``model=``: the names in the tags."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def fsdp1():
        return FSDP1(model(), use_orig_params=True, device_id=torch.device("cpu"),
                     auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))

    def checkpointed():
        net = model()
        net.fc2 = checkpoint_wrapper(net.fc2)
        return DDP(net)

    out = {}
    for label, build in (("ddp", lambda: DDP(model())), ("fsdp1", fsdp1), ("ddp, checkpointed", checkpointed)):
        for given in ("named_parameters()", "model="):
            net = build()
            params, watched = (net.named_parameters(), None) if given == "named_parameters()" else \
                (net.parameters(), net)
            opt = Monitored(torch.optim.AdamW)(params, **OPT, monitor=MonitorConfig(backend="none", every=1,
                                                                                    model=watched))
            loss_of(net, 1, rank, world).backward()
            opt.step()
            out[label, given] = {t.split("/", 1)[1] for t in opt.monitor.latest if t.startswith("param_norm/")}
    return out


def test_ddp_and_fsdp1_give_the_plain_model_s_names(tmp_path):
    """DDP's ``module.``, FSDP1's ``_fsdp_wrapped_module.`` and activation checkpointing's
    ``_checkpoint_wrapped_module.`` are not in the tags: the same layer has the same tag on one
    process and on two."""
    plain = {n for n, _ in model().named_parameters()}
    results = launch(_wrapped_names, 2, tmp_path)
    assert results[0] == results[1]
    assert {case: sorted(names) for case, names in results[0].items() if names != plain} == {}


FABRIC_WAYS = ("Monitored before setup", "attach(setup's optimizer, model=)", "Monitored(module.named_parameters())")
"""How a Fabric user monitors: ``Monitored(AdamW)(net.named_parameters())`` given to ``setup``;
``attach`` on the optimizer ``setup`` returns, the Fabric module as ``model=``; ``setup_module``
first, then ``Monitored(AdamW)(module.named_parameters())`` given to ``setup_optimizers``."""


def _fabric(rank, world, outdir):
    """Each way of :data:`FABRIC_WAYS` under Fabric's DDP strategy on the group ``launch`` made (Fabric
    takes ``LOCAL_RANK`` for processes launched outside it and keeps a group already initialised):
    two steps through ``fabric.backward``; the names, the figures of the second and the true update
    norms (a clone before, the parameters after)."""
    from lightning.fabric import Fabric

    from monitored_optim import attach, monitor_of

    out = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for way in FABRIC_WAYS:
            fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp")
            fabric.launch()
            net = model()
            config = MonitorConfig(backend="none", every=1)
            if way == FABRIC_WAYS[0]:
                module, opt = fabric.setup(net, Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT,
                                                                             monitor=config))
            elif way == FABRIC_WAYS[1]:
                module, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), **OPT))
                attach(opt, MonitorConfig(backend="none", every=1, model=module))
            else:
                module = fabric.setup_module(net)
                opt = fabric.setup_optimizers(Monitored(torch.optim.AdamW)(module.named_parameters(), **OPT,
                                                                           monitor=config))
            for step in (1, 2):
                opt.zero_grad()
                fabric.backward(loss_of(module, step, rank, world))
                before = {n: p.detach().clone() for n, p in net.named_parameters()}
                opt.step()
            out[way] = {"world": (fabric.global_rank, fabric.world_size),
                        "plain": [n for n, _ in net.named_parameters()],
                        "wrapped": [n for n, _ in module.named_parameters()],
                        "latest": dict(opt.monitor.latest), "same monitor": opt.monitor is monitor_of(opt),
                        "truth": {n: (p.detach() - before[n]).norm().item() for n, p in net.named_parameters()},
                        "params": {n: p.detach().clone() for n, p in net.named_parameters()}}
    return {"ways": out, "warnings": [f"{w.category.__name__}: {w.message}" for w in seen]}


def test_fabric_ddp_gives_the_plain_model_s_names(tmp_path):
    """Lightning Fabric's DDP strategy on 2 processes holds the model as ``_forward_module.module.``:
    whichever way the optimizer is monitored, the tags carry the plain model's names (a layer's tag
    on 2 processes is its tag on one), the figures agree across ranks, and ``update_norm/<name>`` is
    the named parameter's true update."""
    pytest.importorskip("lightning.fabric")  # imported here, before the forks
    plain = [n for n, _ in model().named_parameters()]
    results = launch(_fabric, 2, tmp_path)
    for rank, res in enumerate(results):
        assert res["warnings"] == [], (rank, res["warnings"])
        assert list(res["ways"]) == list(FABRIC_WAYS)
        for way, got in res["ways"].items():
            assert got["world"] == (rank, 2) and got["plain"] == plain
            assert got["wrapped"] == [f"_forward_module.module.{n}" for n in plain]  # the prefix is there to strip
            assert got["same monitor"], way
            tags = {t.split("/", 1)[1] for t in got["latest"] if t.startswith("param_norm/")}
            assert tags == set(plain), (rank, way, sorted(tags))
            for name in ("fc1.weight", "norm.weight", "head.bias"):
                assert got["latest"][f"update_norm/{name}"] == pytest.approx(got["truth"][name], rel=NORM_RTOL), \
                    (rank, way, name)
            other = results[1 - rank]["ways"][way]
            assert all(torch.equal(p, other["params"][n]) for n, p in got["params"].items()), (rank, way)  # DDP
            assert got["latest"] == other["latest"], (rank, way)


def _zero(rank, world, outdir, inner: bool):
    net = DDP(model())
    named = list(net.named_parameters())
    groups = [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]
    # The ZeRO step's own broadcasts, counted on a throwaway copy with the same partition.
    spare = copy.deepcopy(net.module)
    plain = ZeroRedundancyOptimizer(list(spare.parameters()), optimizer_class=torch.optim.AdamW, **OPT)
    loss_of(spare, 1, rank, world).backward()
    with CountCollectives() as c:
        plain.step()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if inner:  # the inner optimizer's groups hold this rank's share, its names all of them
            opt = ZeroRedundancyOptimizer(groups, optimizer_class=Monitored(torch.optim.AdamW), **OPT,
                                          monitor=config(outdir))
            result = train(opt, net, rank, world, monitor_of=lambda o: o.optim.monitor)
        else:
            opt = Monitored(ZeroRedundancyOptimizer)(groups, optimizer_class=torch.optim.AdamW, **OPT,
                                                     monitor=config(outdir))
            result = train(opt, net, rank, world)
    told = [str(w.message) for w in seen if "monitored_optim" in str(w.message)]
    return {**result, "plain_ops": len(c.ops), "owned": len(opt.optim.param_groups[0]["params"]), "told": told}


def _zero_inner(rank, world, outdir):
    return _zero(rank, world, outdir, inner=True)


def _zero_outer(rank, world, outdir):
    return _zero(rank, world, outdir, inner=False)


@pytest.mark.parametrize("fn", [_zero_outer, _zero_inner], ids=["Monitored(ZeRO)", "ZeRO(Monitored(AdamW))"])
def test_zero_redundancy_optimizer(fn, tmp_path, want):
    results = launch(fn, 2, tmp_path)
    assert sum(res["owned"] for res in results) == len(list(model().parameters()))  # really partitioned
    assert all(res["told"] == [] for res in results), [res["told"] for res in results]  # no false alarm
    plain = results[0]["plain_ops"]
    assert plain > 0 and all(res["plain_ops"] == plain for res in results)
    print(fn.__name__, check(results, want, tmp_path, plain_ops=plain))


def tp_model():
    """The model on a (2, 2) mesh: fc1 and fc2 tensor parallel over ``tp``, every layer FSDP2 over ``dp``."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    net = model()
    parallelize_module(net, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    for name in ("fc1", "fc2", "norm", "head"):
        fully_shard(getattr(net, name), mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    return net, mesh


def _fsdp2_tp(rank, world, outdir):
    net, mesh = tp_model()
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=config(outdir))
    placements = {n: [type(pl).__name__ for pl in p.placements] for n, p in net.named_parameters()}
    dp = mesh["dp"].get_local_rank()
    return {**train(opt, net, dp, 2), "placements": placements}


def test_fsdp2_x_tensor_parallel_2d_mesh(tmp_path, want):
    results = launch(_fsdp2_tp, 4, tmp_path)
    assert results[0]["placements"]["fc1.weight"] == ["_StridedShard", "Shard"]
    assert results[0]["placements"]["fc2.bias"] == ["Shard", "Replicate"]
    print("fsdp2 x tp", check(results, want, tmp_path))


def _precision(rank, world, outdir):
    """grad_to_data and update_to_data of a LayerNorm weight near 1.0 with std 1e-4, sharded 2 ways,
    against float64 truth from the full tensors (gathered outside the monitored step)."""
    torch.manual_seed(1)
    net = nn.Sequential(OrderedDict(fc=nn.Linear(8, 512), norm=nn.LayerNorm(512)))
    with torch.no_grad():
        net.norm.weight.copy_(1.0 + 1e-4 * torch.randn(512))
    for module in (net.fc, net.norm, net):
        fully_shard(module)
    opt = Monitored(torch.optim.SGD)(net.named_parameters(), lr=1e-3, monitor=MonitorConfig(backend="none"))
    g = torch.Generator().manual_seed(rank)
    net(torch.randn(4, 8, generator=g)).pow(3).mean().backward()
    w = net.norm.weight
    p, grad = w.full_tensor().double(), w.grad.full_tensor().double()
    opt.step()
    u = w.full_tensor().double() - p
    latest = opt.monitor.latest
    return {"grad": (latest["grad_to_data/norm.weight"], math.log10(grad.std().item() / p.std().item())),
            "update": (latest["update_to_data/norm.weight"], math.log10(u.std().item() / p.std().item())),
            "std": p.std().item(), "local": tuple(w.to_local().shape)}


def test_moments_of_a_weight_near_one_combine_to_full_precision(tmp_path):
    """Power sums in float64 keep the spread of a weight whose mean is 1e4 times its std (float32
    power sums would lose all of it): grad_to_data matches float64 truth to 1e-4 in log10, 20 times
    inside the fp32 tolerance. What remains is the float32 rounding of each shard's mean in
    ``stats.moments`` (error ~ 2·δ·Δμ/σ² of the variance, δ the rounding, Δμ the shards' mean gap)."""
    results = launch(_precision, 2, tmp_path)
    for res in results:
        assert res["local"] == (256,) and 5e-5 < res["std"] < 2e-4
        got, truth = res["grad"]
        assert abs(got - truth) < 1e-4, res
        got, truth = res["update"]  # the view's u is the update asked for, truth the one rounded into p
        assert abs(got - truth) < RATIO_TOL, res
    print("precision", {k: abs(results[0][k][0] - results[0][k][1]) for k in ("grad", "update")})


def _partial(rank, world, outdir):
    """A Replicate DTensor parameter fed a Shard(0) input gets a Partial(sum) grad."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    w = nn.Parameter(distribute_tensor(torch.randn(3, 4), mesh, [Replicate()]))
    opt = Monitored(torch.optim.SGD)([("w", w)], lr=0.1, monitor=MonitorConfig(backend="none", every=2))
    counts, truth = [], {}
    for step in (1, 2):
        opt.zero_grad()
        x = DTensor.from_local(torch.randn(5, 3, generator=torch.Generator().manual_seed(10 * step + rank)),
                               mesh, [Shard(0)])
        (x @ w).tanh().sum().backward()
        placements = [type(pl).__name__ for pl in w.grad.placements]
        p, g = w.full_tensor().double(), w.grad.full_tensor().double()
        with CountCollectives() as c:
            opt.step()
        counts.append(c.ops)
        truth = {"grad_norm/w": g.norm().item(), "grad_to_data/w": math.log10(g.std().item() / p.std().item())}
    return {"counts": counts, "truth": truth, "placements": placements,
            "latest": {k: opt.monitor.latest[k] for k in truth}}


def test_partial_grad_is_reduced_before_its_moments(tmp_path):
    """A Partial grad's local tensors are summands, not pieces: it is redistributed to the
    parameter's placements first, one more collective on that logging step."""
    for res in launch(_partial, 2, tmp_path):
        assert res["placements"] == ["Partial"]
        assert res["latest"]["grad_norm/w"] == pytest.approx(res["truth"]["grad_norm/w"], rel=1e-6)
        assert res["latest"]["grad_to_data/w"] == pytest.approx(res["truth"]["grad_to_data/w"], abs=1e-6)
        plain, logging = res["counts"]  # step 1 does not log: the optimizer's own collectives only
        assert logging == plain + ["_c10d_functional.all_reduce.default", *EXCHANGE, "c10d.allreduce_.default"], \
            res["counts"]


def _muon(rank, world, outdir):
    """Muon's update is not element-wise: on FSDP2 shards the monitor clones the shard instead."""
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(fc1=nn.Linear(6, 5, bias=False), act=nn.Tanh(), fc2=nn.Linear(5, 3, bias=False)))
    for module in (net.fc1, net.fc2, net):
        fully_shard(module)
    opt = Monitored(torch.optim.Muon)(net.named_parameters(), lr=2e-2, monitor=MonitorConfig(backend="none"))
    errors = []
    for step in (1, 2):
        opt.zero_grad()
        net(batch(step, rank, world)[0][:, :6]).pow(2).mean().backward()
        before = {n: p.full_tensor().double() for n, p in net.named_parameters()}
        opt.step()
        for n, p in net.named_parameters():
            u = p.full_tensor().double() - before[n]
            truth = math.log10(u.std().item() / before[n].std().item())
            errors.append(abs(opt.monitor.latest[f"update_to_data/{n}"] - truth))
    return max(errors)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_views_that_are_not_elementwise_clone_the_shard(tmp_path):
    for error in launch(_muon, 2, tmp_path):
        assert error < 1e-6


def _stage_params(rank: int) -> list[tuple[str, nn.Parameter]]:
    """Rank ``rank``'s parameters when the ranks hold different ones (stages of a pipeline)."""
    torch.manual_seed(0)
    stages = [nn.Linear(3, 3), nn.Linear(3, 3, bias=False)]
    named = [(f"stage{rank}.{n}", p) for n, p in stages[rank].named_parameters()]
    return named + ([("extra", nn.Parameter(torch.ones(2)))] if rank == 1 else [])


def _stages(rank, world, outdir):
    """Ranks that monitor different parameters: every rank gets the figures of all, by name."""
    named = _stage_params(rank)
    opt = Monitored(torch.optim.AdamW)(named, lr=0.1, monitor=MonitorConfig(backend="none", every=1))
    for step in range(2):
        for _, p in named[:-1] if rank == 1 else named:
            p.grad = torch.full_like(p, 0.1 * (step + 1))
        opt.step()
    return dict(opt.monitor.latest)


def test_ranks_monitoring_different_parameters_get_the_figures_of_all(tmp_path):
    got = launch(_stages, 2, tmp_path)
    named = _stage_params(0) + _stage_params(1)
    opt = Monitored(torch.optim.AdamW)(named, lr=0.1, monitor=MonitorConfig(backend="none", every=1))
    for step in range(2):
        for name, p in named:
            p.grad = None if name == "extra" else torch.full_like(p, 0.1 * (step + 1))
        opt.step()
    assert got[0] == got[1]
    assert {"param_norm/stage0.bias", "param_norm/stage1.weight", "param_norm/extra"} <= set(got[0])
    assert_close_to_reference(got[0], opt.monitor.latest)


def test_single_process_is_untouched(tmp_path, want):
    """Outside torch.distributed: no sharding, and the one process writes the reference's figures."""
    assert not mdist.initialized() and mdist.is_writer()
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))])
    read = mdist.sharding(opt)
    assert isinstance(read, mdist.Unsharded) and read.local is opt and not read.sharded
    net = model()
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=config(str(tmp_path)))
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss_of(net, step).backward()
        opt.step()
    opt.monitor.close()
    lines = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [line.pop("step") for line in lines] == [EVERY, STEPS]
    figures = [{k: v for k, v in got.items() if not k.startswith(COST)} for got in [*lines, want[EVERY], want[STEPS]]]
    assert figures[:2] == figures[2:] and len(figures[0]) > 20


def test_digits_fsdp_example_runs_under_torchrun(tmp_path):
    """examples/digits_fsdp.py on 2 CPU processes: trains, rank 0 alone writes and prints."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "digits_fsdp.py"
    env = {**os.environ, "MONITORED_OPTIM_BACKEND": "jsonl", "MONITORED_OPTIM_LOGDIR": str(tmp_path / "logs"),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(example), "--epochs", "2"], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 2 * 23 + 1))
    assert out.stdout.count("test accuracy") == 1 and "fc2.weight" in out.stdout
    line = next(line for line in out.stdout.splitlines() if line.startswith("head.bias "))
    assert float(line.split()[1]) == round(rows[-1]["update_to_data/head.bias"], 2)


# ----- figure families under sharding ------------------------------------------------------------

FAMILIES_RTOL = 1e-4


def all_figures(outdir: str) -> MonitorConfig:
    return MonitorConfig(backend="none", every=EVERY, logdir=os.path.join(outdir, "logs"), figures="all")


def _with_warnings(build):
    def run(rank, world, outdir):
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net, opt = build(outdir)
            result = train(opt, net, rank, world)
        return {**result, "warnings": [str(w.message) for w in caught if "monitored_optim" in str(w.message)]}
    return run


def _ddp_all(outdir):
    net = DDP(model())
    return net, Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=all_figures(outdir))


def _fsdp2_all(outdir):
    net = model()
    for name in ("fc1", "fc2", "norm", "head"):
        fully_shard(getattr(net, name))
    fully_shard(net)
    return net, Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=all_figures(outdir))


_ddp_all_run, _fsdp2_all_run = _with_warnings(_ddp_all), _with_warnings(_fsdp2_all)


def assert_families_match(got: dict[str, float], want: dict[str, float]) -> None:
    got = {k: v for k, v in got.items() if not k.startswith(COST)}
    want = {k: v for k, v in want.items() if not k.startswith(COST)}
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for tag, value in want.items():
        tol = RATIO_TOL if "_to_data/" in tag else FAMILIES_RTOL * abs(value) + 1e-12
        assert abs(got[tag] - value) <= tol, (tag, got[tag], value)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_every_family_equals_one_process_on_the_global_batch(engine, tmp_path):
    """``figures="all"``: the state family (state norms, eps-dominated shares, normalized update
    RMS) and the spectral family go through the one collective and equal a single-process run of
    the same global batch. Under FSDP2 every matrix is sharded, so the spectral figures are left out
    with one warning that says why, from the writing rank; under DDP each rank holds the whole matrix
    and they are kept."""
    want = reference(tmp_path / "reference", figures="all")
    assert any(t.startswith("update_spectral/") for t in want[STEPS])
    assert any(t.startswith("state_norm/exp_avg_sq/") for t in want[STEPS])
    assert any(t.startswith("eps_dominated/") for t in want[STEPS])
    results = launch(_ddp_all_run if engine == "ddp" else _fsdp2_all_run, 2, tmp_path)
    if engine == "fsdp2":
        want = {step: {t: v for t, v in figures.items()
                       if not t.startswith(("update_spectral/", "update_stable_rank/"))}
                for step, figures in want.items()}
    for rank, res in enumerate(results):
        assert res["latest"] == results[0]["latest"]
        for step, figures in res["latest"].items():
            assert_families_match(figures, want[step])
        for step, ops in enumerate(res["counts"], start=1):
            exchange = EXCHANGE if step == EVERY else []  # the names, once
            assert ops == exchange + ["c10d.allreduce_.default"] * (step % EVERY == 0), (step, ops)
        spectral = [w for w in res["warnings"] if "spectral figures" in w]
        told = engine == "fsdp2" and rank == 0  # one warning, from the writing rank
        assert res["warnings"] == spectral and len(spectral) == told, res["warnings"]


def _ddp_nonfinite_run(rank, world, outdir):
    """One logging step under DDP whose head bias steps to NaN (its grad set NaN on every rank)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = DDP(model())
        opt = Monitored(torch.optim.SGD)(net.named_parameters(), lr=0.1, monitor=MonitorConfig(
            backend="none", every=1, logdir=os.path.join(outdir, "logs")))
        loss_of(net, 1, rank, world).backward()
        net.module.head.bias.grad.fill_(math.nan)
        opt.step()
    return {"writer": mdist.is_writer(), "nonfinite": opt.monitor.latest.get("health/nonfinite"),
            "warnings": [str(w.message) for w in caught if "monitored_optim" in str(w.message)]}


def test_a_health_warning_is_told_by_the_writing_rank_alone(tmp_path):
    """Under DDP every rank counts the non-finite parameter (``health/nonfinite``), and the one
    warning about it comes from rank 0 alone, not once per rank."""
    results = launch(_ddp_nonfinite_run, 2, tmp_path)
    assert [res["writer"] for res in results] == [True, False]
    for res in results:
        assert res["nonfinite"] == 1
        told = [w for w in res["warnings"] if "NaN or Inf" in w]
        assert len(told) == res["writer"] and res["warnings"] == told, res["warnings"]


# ----- histograms --------------------------------------------------------------------------------

def _full(t):
    """A DTensor's full tensor (a collective, outside the monitored step), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def histogram_of(x):
    """numpy's histogram of ``x``'s finite elements, with their min, max and sums (:func:`test_histograms.truth`)."""
    from test_histograms import truth

    return truth(x)


def _histograms(build):
    """Train the engine ``build(outdir) -> (net, opt, part, parts)`` makes with histograms at every
    logging step; per logging step the histograms of every rank and the truth from the full tensors."""
    def run(rank, world, outdir):
        from test_histograms import spacing

        net, opt, part, parts = build(outdir)
        plain = net.module if isinstance(net, DDP) else net  # the tags carry the plain model's names
        out = {}
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            loss_of(net, step, part, parts).backward()
            logs = step % EVERY == 0
            if logs:
                named = list(plain.named_parameters())
                before = {n: _full(p.detach()).clone() for n, p in named}
                grads = {n: _full(p.grad).clone() for n, p in named if p.grad is not None}
            opt.step()
            if logs:
                truth = {}
                for n, p in named:
                    truth[f"update_hist/{n}"] = histogram_of(_full(p.detach()) - before[n])
                    truth[f"param_hist/{n}"] = histogram_of(_full(p.detach()))
                    if n in grads:
                        truth[f"grad_hist/{n}"] = histogram_of(grads[n])
                out[step] = (dict(opt.monitor.histograms), truth,
                             {f"update_hist/{n}": spacing(_full(p.detach())) for n, p in named})
        return out
    return run


def _hist_config(outdir):
    return MonitorConfig(backend="jsonl", every=EVERY, logdir=os.path.join(outdir, "logs"), figures="histograms")


def _ddp_hist(outdir):
    net = DDP(model())
    rank, world = dist.get_rank(), dist.get_world_size()
    return net, Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=_hist_config(outdir)), rank, world


def _fsdp2_hist(outdir):
    net = model()
    for name in ("fc1", "fc2", "norm", "head"):
        fully_shard(getattr(net, name))
    fully_shard(net)
    rank, world = dist.get_rank(), dist.get_world_size()
    return net, Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=_hist_config(outdir)), rank, world


def _tp_hist(outdir):
    net, mesh = tp_model()
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=_hist_config(outdir))
    return net, opt, mesh["dp"].get_local_rank(), 2


_ddp_hist_run, _fsdp2_hist_run, _tp_hist_run = _histograms(_ddp_hist), _histograms(_fsdp2_hist), _histograms(_tp_hist)


@pytest.mark.parametrize("engine,world", [("ddp", 2), ("fsdp2", 2), ("fsdp2 x tp", 4)])
def test_histograms_of_every_rank_equal_the_full_tensors_and_one_process(engine, world, tmp_path):
    """Every rank's histograms (their counts summed over the shards in the one collective, weighted
    where ranks hold replicas) equal numpy's of the full tensors gathered outside the step, bin for
    bin, and a single process on the global batch (on this data no rounding of the engines' grad
    averaging moves a value across an edge); their min and max (the extremes of the shards' in the
    same collective) and sums are the full tensors' and the single process's (the update and p within
    a spacing of p, the grad within 32 of its own: the engines' grad averaging rounds)."""
    from test_histograms import assert_all_exact, record, spacing

    run = {"ddp": _ddp_hist_run, "fsdp2": _fsdp2_hist_run, "fsdp2 x tp": _tp_hist_run}[engine]
    results = launch(run, world, tmp_path)
    net = model()
    single = Monitored(torch.optim.AdamW)(net.named_parameters(), **OPT, monitor=MonitorConfig(
        backend="none", every=EVERY, figures="histograms"))
    for step in range(1, STEPS + 1):
        single.zero_grad()
        loss_of(net, step).backward()
        single.step()
        if step % EVERY:
            continue
        for res in results:
            got, truth, spaced = res[step]  # u rebuilt from the state: within a spacing of p
            assert {t: record(h) for t, h in got.items()} == {t: record(h) for t, h in results[0][step][0].items()}
            assert_all_exact(got, truth, spaced)
        spaced = {**spaced, **{t.replace("update_hist/", "param_hist/"): s for t, s in spaced.items()},
                  **{f"grad_hist/{n}": 32 * spacing(p.grad) for n, p in net.named_parameters()}}
        assert_all_exact(single.monitor.histograms, results[0][step][0], spaced)  # p within a spacing too, the
        # grad within 32 of its own: the ranks' sums of the batch are added in another order
    lines = (tmp_path / "logs" / "histograms.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [s for s in range(1, STEPS + 1) if s % EVERY == 0]


def _failing_hist(rank, world, outdir):
    """DDP with histograms (their wide and slotted rows in the table); rank 1 fails to build its part
    of the table at the logging step: every rank gets the failure from the one collective."""
    from monitored_optim.distributed import table

    net, opt, part, parts = _ddp_hist(outdir)
    if rank == 1:
        def broken(*args, **kwargs):
            raise ValueError("broken on purpose")

        table._put_wide = broken
    for step in range(1, EVERY + 1):
        opt.zero_grad()
        loss_of(net, step, part, parts).backward()
        try:
            opt.step()
        except RuntimeError as err:
            return step, str(err)
    return EVERY, None


def test_a_rank_that_fails_to_build_its_table_fails_every_rank_with_histograms_on(tmp_path):
    """The failing rank's table has the others' rows (its wide and per-rank slot rows too), so the
    collective completes and every rank raises, none hangs."""
    results = launch(_failing_hist, 2, tmp_path)
    for rank, (step, message) in enumerate(results):
        assert step == EVERY and message is not None and "1 rank(s) could not reduce their figures" in message, rank
    assert "ValueError: broken on purpose" in results[1][1] and "this rank" not in results[0][1]


def _notices(rank, world, outdir):
    """Under DDP, on every rank: an SGD with momentum state attached (it keeps no step count), two logging
    steps, then the step set back below them. The warnings each rank raised."""
    import warnings

    from monitored_optim import attach

    net = DDP(model())
    sgd = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
    loss_of(net, 1, rank, world).backward()
    sgd.step()  # momentum state, no count
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt = attach(sgd, MonitorConfig(backend="none", every=1, model=net))
        for step in (2, 3):
            opt.zero_grad()
            loss_of(net, step, rank, world).backward()
            opt.step()
        opt.monitor.step = 1
    return [str(w.message) for w in seen]


def test_a_notice_about_the_step_axis_comes_from_the_writing_rank_alone(tmp_path):
    """The "keeps no step count" notice of attach() and the "moves back" notice of a step set below a
    logged one are each raised once, by rank 0, which writes the figures."""
    told = launch(_notices, 2, tmp_path)
    assert told[1] == []
    assert len(told[0]) == 2 and "keeps no step count" in told[0][0] and "moves back from 2 to 1" in told[0][1]

"""The ``View`` protocol: every capability a view may declare, with its default, and what the
monitor does with a registered third-party view by what it declares (``elementwise``: cut into
parts, rebuilt from a shard; else whole, cloned per shard)."""

from __future__ import annotations

import functools
import re
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import truth
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.updates import Cloned, View, elementwise, rebuild, register, view_for
from monitored_optim.workspace import PART_ELEMENTS
from thirdparty import SignMomentum

SHAPE = (600, 500)
"""A weight of more than PART_ELEMENTS elements: cut into parts where its view is element-wise."""
assert SHAPE[0] * SHAPE[1] > PART_ELEMENTS


class SignMomentumView(View):
    """u = -lr·sign(m) from the stored momentum m (exact: the sign the step used); records the element
    count of every parameter (or part, or shard) it is asked to rebuild."""

    elementwise = True

    def __init__(self) -> None:
        self.calls: list[int] = []

    def update(self, group, p, state, snapshot):
        self.calls.append(p.numel())
        return None if p.grad is None else state["momentum_buffer"].sign().mul_(-group["lr"])


class DuckSignMomentumView:
    """The same view duck-typed (no ``View`` base): ``before``, ``update`` and, where given, ``elementwise``."""

    def __init__(self, elementwise: bool | None) -> None:
        if elementwise is not None:
            self.elementwise = elementwise
        self.calls: list[int] = []

    def before(self, group, p, state):
        return None

    update = SignMomentumView.update


class DuckElementwise(SignMomentum):
    """SignMomentum with a step of its own, for a view of its own."""

    @torch.no_grad()
    def step(self, closure=None):
        return super().step(closure)


class DuckWhole(SignMomentum):
    """SignMomentum with a step of its own, for a view that does not say it is element-wise."""

    @torch.no_grad()
    def step(self, closure=None):
        return super().step(closure)


register(SignMomentum, SignMomentumView())
register(DuckElementwise, DuckSignMomentumView(True))
register(DuckWhole, DuckSignMomentumView(None))
CLASSES = {"view": SignMomentum, "duck": DuckElementwise, "whole": DuckWhole}


def test_a_view_subclass_gets_every_default():
    """A ``View`` subclass declaring ``update`` alone: nothing to snapshot, ``update_many`` the loop
    over ``update``, grads kept, no fused form, not element-wise; without ``update`` it cannot be built."""

    class Minimal(View):
        def update(self, group, p, state, snapshot):
            return p.grad * 2

    view, p, group = Minimal(), torch.ones(3), {"lr": 1.0}
    p.grad = torch.full((3,), 0.5)
    assert view.before(group, p, {}) is None and not view.elementwise and not elementwise(view)
    assert view.keeps_grad(group) and not view.fusable(group) and view.fused(group, [p], [{}]) is None
    assert [u.tolist() for u in rebuild(view, group, [p, p], [{}, {}], [None, None])] == [[1.0] * 3] * 2

    class NoUpdate(View):
        pass

    with pytest.raises(TypeError, match="abstract"):
        NoUpdate()


def test_a_registered_duck_typed_view_gets_the_defaults_and_stays_itself():
    """``register`` fills what a view without the ``View`` base leaves out; its own ``elementwise`` stays."""
    for cls, flag in ((DuckElementwise, True), (DuckWhole, False)):
        view, group = view_for(cls), {"lr": 1.0}
        assert isinstance(view, DuckSignMomentumView) and view.elementwise is flag and elementwise(view) is flag
        assert view.keeps_grad(group) and not view.fusable(group) and view.fused(group, [], []) is None
        p = torch.ones(4)
        p.grad = torch.ones(4)
        assert [u.tolist() for u in view.update_many(group, [p], [{"momentum_buffer": -p}], [None])] == [[1.0] * 4]



def _sgd_step(self, closure=None):
    return torch.optim.SGD.step(self, closure)


class _Checked:
    """A duck-typed view (cloning) whose ``bound`` the tests below replace."""

    def before(self, group, p, state):
        return Cloned.of(p)

    def update(self, group, p, state, snapshot):
        return snapshot.update(p)


@pytest.mark.parametrize("bound", [lambda opt: None, lambda opt: 42])
def test_a_registered_views_bound_that_returns_no_view_fails_at_construction_naming_bound(bound):
    """``bound()`` of a registered view answering something that is not a view: the monitored
    optimizer's construction fails with a message naming ``bound()`` (not ``register()``, which the
    user called with a good view)."""
    view = _Checked()
    view.bound = bound
    cls = type("BoundChecked", (torch.optim.SGD,), {"step": _sgd_step})
    register(cls, view)
    with pytest.raises(TypeError, match=r"_Checked\.bound\(\) returned .* not a view"):
        Monitored(cls)([nn.Parameter(torch.ones(3))], lr=0.1, monitor=MonitorConfig(backend="none"))


def test_register_refuses_a_capability_that_is_not_a_method():
    """``bound = 5`` (or any capability View has as a method, given as a non-callable) is refused by
    ``register()`` rather than failing later with "'int' object is not callable"."""
    view = _Checked()
    view.bound = 5
    cls = type("BoundFive", (torch.optim.SGD,), {"step": _sgd_step})
    with pytest.raises(TypeError, match="'bound' of .* to be a method"):
        register(cls, view)


@pytest.mark.parametrize("kind", ["view", "duck", "whole"])
def test_a_large_parameter_of_a_third_party_elementwise_view_is_reduced_in_parts(kind, tmp_path):
    """A third-party view that says it is element-wise rebuilds a weight of more than PART_ELEMENTS
    elements a part at a time (``describe()`` names the parts); one that does not, whole. Every
    logging step's figures equal the clone truth."""
    cls = CLASSES[kind]
    gen = torch.Generator().manual_seed(0)
    named = [("w", nn.Parameter(torch.randn(SHAPE, generator=gen))), ("b", nn.Parameter(torch.zeros(SHAPE[0])))]
    opt = Monitored(cls)(named, lr=1e-3, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    view = opt.monitor._engine.view
    assert view is view_for(cls)
    row = next(line for line in opt.monitor.describe().splitlines() if line.startswith("w "))
    slices = re.search(r"in (\d+) slices", row)
    assert (slices is not None) == (kind != "whole"), row
    for _ in range(3):
        view.calls.clear()
        for _, p in named:
            p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
        before, grads = truth.snapshot(named)
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))
        large = [n for n in view.calls if n > SHAPE[0]]  # the bias is copied flat, never rebuilt
        if kind == "whole":
            assert large == [SHAPE[0] * SHAPE[1]]
        else:
            assert len(large) == int(slices.group(1)) > 1 and sum(large) == SHAPE[0] * SHAPE[1], large


# ----- sharded: DDP replicas keep the view, FSDP2 shards are rebuilt by an element-wise view ------

def _sharded(rank, world, outdir, kind: str, engine: str):
    """Two logging steps of a Linear(500, 600) under ``engine``, each one's figures checked against a
    clone of the full tensors; returns per step the element counts the view rebuilt, and the local shapes."""
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(fc=nn.Linear(SHAPE[1], SHAPE[0])))
    if engine == "fsdp2":
        fully_shard(net)
    else:
        net = DDP(net)
    named = list(net.named_parameters())
    opt = Monitored(CLASSES[kind])(named, lr=1e-3, monitor=MonitorConfig(backend="none"))
    named = list((net.module if engine == "ddp" else net).named_parameters())  # the model's own names: the tags'
    full = (lambda t: t.full_tensor()) if engine == "fsdp2" else (lambda t: t)
    calls, local = [], {n: tuple(p.to_local().shape) if engine == "fsdp2" else tuple(p.shape) for n, p in named}
    for step in (1, 2):
        opt.zero_grad()
        x = torch.randn(4, SHAPE[1], generator=torch.Generator().manual_seed(10 * step + rank))
        net(x).tanh().square().mean().backward()
        before = {n: full(p.detach()).clone() for n, p in named}
        grads = {n: full(p.grad).clone() for n, p in named}
        opt.monitor._engine.view.calls.clear()
        opt.step()
        after = [(n, full(p.detach())) for n, p in named]
        truth.assert_figures_match(opt.monitor.latest, truth.figures(after, before, grads))
        calls.append(list(opt.monitor._engine.view.calls))
    return {"calls": calls, "local": local}


gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                          reason="torch.distributed with gloo is not available")


@gloo
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
@pytest.mark.parametrize("kind", ["view", "duck", "whole"])
def test_sharded_parameters_of_an_elementwise_third_party_view_are_rebuilt_not_cloned(kind, engine, tmp_path):
    """Under DDP (whole replicas) the view rebuilds every parameter. Under FSDP2 (dim-0 shards) a view
    that says it is element-wise rebuilds each rank's shard; one that does not is given a clone of the
    shard, as the built-in views that are not element-wise are. Figures equal a clone of the full
    tensors on every rank."""
    from test_distributed import launch

    results = launch(functools.partial(_sharded, kind=kind, engine=engine), 2, tmp_path)
    for res in results:
        weight = next(torch.Size(s).numel() for n, s in res["local"].items() if n.endswith("weight"))
        want = [] if engine == "fsdp2" and kind == "whole" else [weight]  # the bias is snapshotted (a vector)
        assert [sorted(calls, reverse=True) for calls in res["calls"]] == [want, want], res
    if engine == "fsdp2":
        assert results[0]["local"]["fc.weight"] == (SHAPE[0] // 2, SHAPE[1])

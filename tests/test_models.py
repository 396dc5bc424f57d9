"""The names a monitor gives parameters after the models that hold them (:mod:`monitored_optim.models`)."""

from __future__ import annotations

import gc

import pytest
from torch import nn

from monitored_optim.models import Models


def test_a_name_goes_with_its_parameter():
    """A watched model that dies takes its parameters' names along: a tensor that later gets one of
    their ids is not named after it."""
    models = Models()
    kept, gone = nn.Linear(2, 2), nn.Linear(3, 3)
    models.watch(kept)
    models.watch(gone)
    ids = {id(p) for p in gone.parameters()}
    assert {models.names[i] for i in ids} == {"weight", "bias"}
    del gone
    gc.collect()
    assert not ids & set(models.names)
    assert {models.names[id(p)] for p in kept.parameters()} == {"weight", "bias"}
    assert [m is kept for m in models.watched()] == [True]


def test_a_name_known_before_stays():
    models = Models()
    net = nn.Sequential(nn.Linear(2, 2))
    models.name(net[0].weight, "encoder.weight")
    models.watch(net)
    assert models.names[id(net[0].weight)] == "encoder.weight" and models.names[id(net[0].bias)] == "0.bias"


def test_a_compiled_model_names_its_parameters_as_the_model_does():
    """``MonitorConfig(model=torch.compile(net))`` and ``watch(torch.compile(net))``: the figures carry
    ``net``'s names, not ``_orig_mod.``-prefixed ones (the compiled wrapper is never called here)."""
    import torch

    from monitored_optim import Monitored, MonitorConfig

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    compiled = torch.compile(net)
    assert next(iter(dict(compiled.named_parameters()))).startswith("_orig_mod.")
    opt = Monitored(torch.optim.AdamW)(list(net.parameters()), lr=1e-2,
                                       monitor=MonitorConfig(backend="none", every=1, model=compiled))
    assert opt.monitor.watch(compiled) == []
    net(torch.randn(3, 4)).square().mean().backward()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt.step()
    norms = {tag.split("/", 1)[1]: value for tag, value in opt.monitor.latest.items() if tag.startswith("update_norm/")}
    assert set(norms) == set(before)
    for name, p in net.named_parameters():
        assert norms[name] == pytest.approx((p.detach().double() - before[name].double()).norm().item(), rel=1e-6)


def test_the_names_of_a_compiled_model_s_named_parameters_lose_the_wrapper_s_prefix():
    """``Monitored(cls)(torch.compile(net).named_parameters())`` (no ``model=``), the wrapper nested
    inside a module too: the figures carry ``net``'s names; a module whose own name merely ends in
    ``_orig_mod`` keeps it."""
    import torch

    from monitored_optim import Monitored, MonitorConfig

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    net = nn.ModuleDict({"body": torch.compile(inner), "x_orig_mod": nn.Linear(8, 2)})
    named = list(net.named_parameters())
    assert {n for n, _ in named} >= {"body._orig_mod.0.weight", "x_orig_mod.weight"}
    opt = Monitored(torch.optim.AdamW)(named, lr=1e-2, monitor=MonitorConfig(backend="none", every=1))
    net["x_orig_mod"](inner(torch.randn(3, 4))).square().mean().backward()
    opt.step()
    norms = {tag.split("/", 1)[1] for tag in opt.monitor.latest if tag.startswith("update_norm/")}
    assert norms == {n.replace("._orig_mod", "") for n, _ in named}
    assert "body.0.weight" in norms and "x_orig_mod.weight" in norms

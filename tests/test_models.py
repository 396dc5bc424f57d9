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


# ----- one name per layer, whatever wraps it ------------------------------------------------------

PLAIN = {"0.weight", "0.bias", "2.weight", "2.bias"}
"""The names :func:`_net` gives its parameters, wrapped or not."""


def _net() -> nn.Module:
    """Linear -> Tanh -> Linear, its first layer under activation checkpointing's wrapper (whose
    ``_checkpoint_wrapped_module`` is in the names the model's ``named_parameters()`` gives)."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    return nn.Sequential(checkpoint_wrapper(nn.Linear(4, 8)), nn.Tanh(), nn.Linear(8, 2))


def _tags(params, model=None, forward=None, attached: bool = False) -> set[str]:
    """The names in the tags of one monitored SGD step on ``params`` (a model given as ``model=``):
    an SGD built from ``Monitored(SGD)``, or plain and attached where ``attached``, or the optimizer
    ``params`` is, attached; ``forward``: the module called (``model`` unless given)."""
    import torch

    from monitored_optim import Monitored, MonitorConfig, attach, monitor_of

    config = MonitorConfig(backend="none", every=1, model=model)
    if hasattr(params, "step"):  # an optimizer built already
        opt = attach(params, config)
    elif attached:
        opt = attach(torch.optim.SGD(params, lr=0.1), config)
    else:
        opt = Monitored(torch.optim.SGD)(params, lr=0.1, monitor=config)
    (forward or model)(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    return {tag.split("/", 1)[1] for tag in monitor_of(opt).latest if tag.startswith("param_norm/")}


def test_wrapped_models_give_the_plain_model_s_names():
    """``DataParallel`` (its ``module.``, as DDP's and a DeepSpeed engine's), activation checkpointing
    (``_checkpoint_wrapped_module.``) and ``torch.compile`` (``_orig_mod.``), one inside the other:
    the tags carry the plain model's names, given as ``named_parameters()``, as ``model=``, or both,
    through ``Monitored`` and ``attach``."""
    import torch

    net = _net()
    wrapped = nn.DataParallel(net)  # on CPU: a wrapper that calls the model
    assert {n for n, _ in wrapped.named_parameters()} == {"module.0._checkpoint_wrapped_module.weight",
                                                          "module.0._checkpoint_wrapped_module.bias",
                                                          "module.2.weight", "module.2.bias"}
    compiled = torch.compile(wrapped)  # never called here
    assert _tags(net.named_parameters(), forward=net) == PLAIN
    assert _tags(wrapped.named_parameters(), forward=wrapped) == PLAIN
    assert _tags(compiled.named_parameters(), forward=wrapped) == PLAIN
    assert _tags(list(wrapped.parameters()), model=wrapped) == PLAIN
    assert _tags(list(net.parameters()), model=compiled, forward=wrapped) == PLAIN
    assert _tags(wrapped.named_parameters(), model=wrapped, attached=True) == PLAIN
    assert _tags(list(wrapped.parameters()), model=wrapped, attached=True) == PLAIN


class _Holder(nn.Module):
    """A model whose own submodule is named ``module``, as a wrapper's is."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(4, 2)

    def forward(self, x):
        return self.module(x)


def test_a_model_s_own_submodule_named_module_keeps_its_name():
    """A ``module.`` that the model itself has is no wrapper's: it stays, alone or under a wrapper
    that adds one of its own (whose ``module.module.weight`` is the model's ``module.weight``)."""
    own = {"module.weight", "module.bias"}
    net = _Holder()
    assert _tags(net.named_parameters(), forward=net) == own
    assert _tags(list(net.parameters()), model=net) == own
    wrapped = nn.DataParallel(net)
    assert _tags(wrapped.named_parameters(), forward=wrapped) == own
    assert _tags(list(wrapped.parameters()), model=wrapped) == own
    assert _tags(net.named_parameters(), forward=wrapped) == own  # the same tensors, named by the model


def test_names_that_meet_after_the_wrappers_are_left_out_stay_apart():
    """A model whose own names become one another's once the wrappers' components are left out
    (``x.weight`` and ``_orig_mod.x.weight``): each parameter keeps a tag of its own."""
    net = nn.ModuleDict({"x": nn.Linear(4, 2), "_orig_mod": nn.ModuleDict({"x": nn.Linear(4, 2)})})
    both = lambda x: net["x"](x) + net["_orig_mod"]["x"](x)  # noqa: E731
    tags = _tags(net.named_parameters(), forward=both)
    assert len(tags) == 4 and {"x.weight", "x.bias"} <= tags
    assert len(_tags(list(net.parameters()), model=net, forward=both)) == 4


@pytest.mark.skipif(not __import__("importlib").util.find_spec("lightning"), reason="lightning is not installed")
def test_a_fabric_module_gives_the_plain_model_s_names():
    """Lightning Fabric's ``setup`` wraps the model (``_forward_module.``) and the optimizer:
    ``attach(opt, MonitorConfig(model=model))`` and the wrapper's ``named_parameters()`` give the
    plain model's names."""
    import torch
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    net = _net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert next(iter(dict(model.named_parameters()))).startswith("_forward_module.")
    assert _tags(opt, model=model, attached=True) == PLAIN
    assert _tags(model.named_parameters(), forward=model) == PLAIN

"""The names a monitor gives parameters after the models that hold them (:mod:`monitored_optim.models`)."""

from __future__ import annotations

import gc

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

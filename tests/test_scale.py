"""Many parameters: choosing what is monitored (costs nothing when left out), figure families,
grouping by depth, and the tag budget for TensorBoard and W&B (JSONL keeps everything)."""

from __future__ import annotations

import json
import statistics
import warnings

import pytest
import torch
from torch import nn

from monitored_optim import Monitored, MonitorConfig
from monitored_optim.grouping import depth_key
from test_backends import read_tensorboard
from test_syncs import OpLog


def stack(layers: int, width: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def step_once(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(2, model[0].in_features)).square().mean().backward()
    opt.step()


def random_step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """A step on random grads (a deep stack's backpropagated grads vanish)."""
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def extra_ops(model: nn.Module, monitor: MonitorConfig) -> list[str]:
    """The aten ops a logging step dispatches beyond the plain optimizer's step, on this model."""
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step_once(model, plain)
    opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=0.1, momentum=0.9, monitor=monitor)
    with pytest.warns(RuntimeWarning, match="no step count"):
        opt.load_state_dict(plain.state_dict())
    model(torch.randn(2, model[0].in_features)).square().mean().backward()
    with OpLog() as base:
        plain.step()
    with OpLog() as log:
        opt.step()
    return sorted(set_difference(log.ops, base.ops))


def set_difference(ops: list[str], base: list[str]) -> list[str]:
    """``ops`` less one occurrence of each op in ``base`` (a multiset difference)."""
    left = list(ops)
    for op in base:
        left.remove(op)
    return left


def test_a_parameter_left_out_costs_nothing(tmp_path):
    """The monitor's own ops on a logging step of a 6-layer model with layers 1-5 left out are the
    ops it dispatches for the 1-layer model that is layer 0 alone."""
    chosen = extra_ops(stack(6), MonitorConfig(backend="none", logdir=tmp_path, params="0.*"))
    alone = extra_ops(stack(1), MonitorConfig(backend="none", logdir=tmp_path))
    assert chosen == alone and chosen


@pytest.mark.parametrize("config,expected", [
    (dict(params="1.*"), {"1.weight", "1.bias"}),
    (dict(params=["*.weight", "!2.*"]), {"0.weight", "1.weight"}),
    (dict(exclude="*.bias"), {"0.weight", "1.weight", "2.weight"}),
    (dict(params=lambda name, p: p.dim() < 2), {"0.bias", "1.bias", "2.bias"}),
], ids=["glob", "globs-and-not", "exclude", "callable"])
def test_selection_picks_the_tags_and_the_health_counts(config, expected, tmp_path):
    model = stack(3)
    opt = Monitored(torch.optim.Adam)(model.named_parameters(), lr=1e-2,
                                      monitor=MonitorConfig(backend="none", logdir=tmp_path, **config))
    want = sum(p.detach().double().norm().item() ** 2 for n, p in model.named_parameters() if n in expected) ** 0.5
    step_once(model, opt)
    latest = opt.monitor.latest
    assert {t.split("/", 1)[1] for t in latest if t.startswith("update_norm/")} == expected
    assert latest["global/param_norm"] == pytest.approx(want, rel=1e-6)
    assert latest["health/no_grad"] == 0


def test_a_selection_that_matches_nothing_warns(tmp_path):
    with pytest.warns(RuntimeWarning, match="matches none of the 6 parameters.*'0.weight'"):
        Monitored(torch.optim.SGD)(stack(3).named_parameters(), lr=0.1,
                                   monitor=MonitorConfig(backend="none", logdir=tmp_path, params="layers.*"))


def test_selection_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MONITORED_OPTIM_PARAMS", "0.weight, 2.*")
    model = stack(3)
    opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=0.1, monitor=MonitorConfig(backend="none"))
    step_once(model, opt)
    assert {t.split("/", 1)[1] for t in opt.monitor.latest if t.startswith("param_norm/")} == \
        {"0.weight", "2.weight", "2.bias"}


def test_figure_families_choose_what_is_sent(tmp_path):
    """Without a family that reads the grads (grad_to_data, norms, health) they are not reduced,
    and no health warning claims they are missing."""
    model = stack(2)
    opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=0.1, monitor=MonitorConfig(
        backend="none", logdir=tmp_path, figures=["update_to_data", "lr"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            step_once(model, opt)
    assert {t.split("/", 1)[0] for t in opt.monitor.latest} == {"update_to_data", "lr"}
    with pytest.raises(ValueError, match="'gradnorm' is unknown.*update_to_data, grad_to_data, norms"):
        Monitored(torch.optim.SGD)(model.named_parameters(), lr=0.1, monitor=MonitorConfig(figures="gradnorm"))


def test_depth_key():
    assert depth_key("transformer.h.11.attn.c_attn.weight") == ("transformer.h.*.attn.c_attn.weight", 11)
    assert depth_key("layers.3.experts.7.w1") == ("layers.*.experts.7.w1", 3)
    assert depth_key("0.weight") == ("*.weight", 0)
    assert depth_key("lm_head.weight") is None


def test_over_the_budget_tensorboard_gets_depth_summaries_and_jsonl_everything(tmp_path):
    """1,000 linear layers (2,000 tensors, about 10,000 tags a step) against the default budget of
    2,000: TensorBoard gets the summaries over depth, which equal those computed here from
    metrics.jsonl's rows."""
    model = stack(1000)
    opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=0.1, monitor=MonitorConfig(
        backend="tensorboard,jsonl", logdir=tmp_path))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        random_step(model, opt, gen)
    opt.monitor.close()
    full = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(full[-1]) - 1 == len(opt.monitor.latest) > 9000  # every per-parameter figure
    tb = read_tensorboard(tmp_path)
    assert sorted(tb) == [1, 2] and all(len(tags) <= 2000 for tags in tb.values())
    ratios = {int(k.split("/")[1].split(".")[0]): v for k, v in full[-1].items()
              if k.startswith("update_to_data/") and k.endswith(".weight")}
    low = min(ratios, key=ratios.get)
    assert tb[2]["update_to_data/*.weight/min"] == pytest.approx(ratios[low], rel=1e-6)
    assert tb[2]["update_to_data/*.weight/argmin"] == low
    assert tb[2]["update_to_data/*.weight/median"] == pytest.approx(statistics.median(ratios.values()), rel=1e-6)
    assert "global/update_norm" in tb[2] and "update_to_data/0.weight" not in tb[2]


def test_under_the_budget_every_tag_is_sent(tmp_path):
    model = stack(3)
    opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=0.1, monitor=MonitorConfig(
        backend="tensorboard", logdir=tmp_path))
    step_once(model, opt)
    opt.monitor.close()
    assert set(read_tensorboard(tmp_path)[1]) == set(opt.monitor.latest)


def test_over_the_budget_every_family_is_grouped_by_depth(tmp_path):
    """``figures="all"`` over the budget: the state and spectral families' per-parameter tags are
    summarised over depth like the core ones (none passes through ungrouped), and their medians
    equal those computed here from metrics.jsonl's rows."""
    model = stack(100)
    opt = Monitored(torch.optim.Adam)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(
        backend="tensorboard,jsonl", logdir=tmp_path, figures="all", tag_budget=300))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        random_step(model, opt, gen)
    opt.monitor.close()
    full = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    series = {"state_norm/exp_avg", "state_norm/exp_avg_sq", "eps_dominated", "normalized_update_rms",
              "update_spectral", "update_stable_rank", "update_to_data"}
    assert series <= {tag.rsplit("/", 1)[0] for tag in full if tag.endswith("/0.weight")}
    tb = read_tensorboard(tmp_path)[2]
    assert len(tb) <= 300
    ungrouped = [tag for tag in tb if "/" in tag and tag.split("/", 1)[0] not in ("global", "lr", "health", "monitor")
                 and "*" not in tag]
    assert not ungrouped
    for name in series:
        weights = [v for k, v in full.items() if k.startswith(f"{name}/") and k.endswith(".weight")
                   and k.count("/") == name.count("/") + 1]
        assert len(weights) == 100
        assert tb[f"{name}/*.weight/median"] == pytest.approx(statistics.median(weights), rel=1e-6)

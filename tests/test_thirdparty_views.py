"""State-aware views of third-party optimizers (``monitored_optim/updates/thirdparty.py``), each
against the real package: figures equal the clone truth on the grid's initialisations (1.0, 0,
N(0, 0.02)) and learning rates (warmup's 1e-7 included), the trajectory is the plain optimizer's
bit for bit, ``describe()`` names the view, and verify mode finds the view's update exact."""

from __future__ import annotations

import itertools
import re
import warnings

import pytest
import torch

import truth
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.updates import Cloned, Summed
from test_exactness import assert_state_dicts_equal


CASES = {
    # id: (module, optimizer class, its arguments beyond lr (an lr here replaces the test's), view name)
    "lion-pytorch": ("lion_pytorch", "Lion", {}, "LucidrainsLionView"),
    "lion-pytorch-wd": ("lion_pytorch", "Lion", dict(weight_decay=0.1), "LucidrainsLionView"),
    "optimizer-lion": ("pytorch_optimizer", "Lion", {}, "OptimizerLionView"),
    "optimizer-lion-wd": ("pytorch_optimizer", "Lion", dict(weight_decay=0.1), "OptimizerLionView"),
    "optimizer-lion-coupled-maximize": ("pytorch_optimizer", "Lion",
                                        dict(weight_decay=1e-3, weight_decouple=False, maximize=True),
                                        "OptimizerLionView"),
    "bnb-adam": ("bitsandbytes.optim", "Adam", dict(optim_bits=32), "BnbAdamView"),
    "bnb-adamw": ("bitsandbytes.optim", "AdamW", dict(optim_bits=32, weight_decay=0.1), "BnbAdamView"),
    "prodigy": ("prodigyopt", "Prodigy", dict(d0=1e-3), "ProdigyView"),
    "prodigy-decoupled": ("prodigyopt", "Prodigy", dict(d0=1e-3, weight_decay=0.1), "ProdigyView"),
    "prodigy-coupled-bc": ("prodigyopt", "Prodigy", dict(d0=1e-3, weight_decay=1e-3, decouple=False,
                                                          use_bias_correction=True), "ProdigyView"),
    "prodigy-beta1-0": ("prodigyopt", "Prodigy", dict(d0=1e-3, betas=(0.0, 0.99)), "ProdigyView"),
    "hf-adafactor": ("transformers.optimization", "Adafactor", dict(relative_step=False, scale_parameter=False),
                     "HfAdafactorView"),
    "hf-adafactor-scale-wd": ("transformers.optimization", "Adafactor",
                              dict(relative_step=False, weight_decay=0.1), "HfAdafactorView"),
    "hf-adafactor-beta1-wd": ("transformers.optimization", "Adafactor",
                              dict(relative_step=False, beta1=0.9, weight_decay=0.1), "HfAdafactorView"),
    "hf-adafactor-relative": ("transformers.optimization", "Adafactor", dict(lr=None, warmup_init=True),
                              "HfAdafactorView"),
    "sf-adamw": ("schedulefree", "AdamWScheduleFree", {}, "AdamWScheduleFreeView"),
    "sf-adamw-wd-warmup": ("schedulefree", "AdamWScheduleFree", dict(weight_decay=0.1, warmup_steps=2),
                           "AdamWScheduleFreeView"),
    "sf-sgd-wd": ("schedulefree", "SGDScheduleFree", dict(weight_decay=0.1), "SGDScheduleFreeView"),
    "sf-radam": ("schedulefree", "RAdamScheduleFree", {}, "RAdamScheduleFreeView"),
    "sf-radam-sgd-phase": ("schedulefree", "RAdamScheduleFree", dict(silent_sgd_phase=False),
                           "RAdamScheduleFreeView"),
}
CLONED = {"lion-pytorch-wd"}
"""Cases whose view clones every parameter (lion-pytorch keeps its decay's divisor out of the group)."""
VERIFY_LR = {"sf-sgd-wd": 1e-1, "sf-radam-sgd-phase": 1e-1}
"""Learning rates of the verify test other than 1e-3: schedule-free steps on the raw gradient (SGD, and
RAdam before its rectification) are at 1e-3 so small next to p that the view clones (its rebuild
misses by one spacing on a share of the elements)."""
INITS = ("ones", "zeros", "normal")
LRS = (1e-2, 1e-4, 1e-7)
STEPS = 3
HEALTH = r"has not changed for 3 logging steps|NaN or Inf"
"""The only warnings these inputs may call for (a matrix that 1e-7 steps do not move)."""


def _build(case: str, named, lr: float, monitor: MonitorConfig | None):
    module, name, kwargs, _ = CASES[case]
    cls = getattr(pytest.importorskip(module), name)
    kwargs = {"lr": lr, **kwargs}
    opt = cls(named, **kwargs) if monitor is None else Monitored(cls)(named, **kwargs, monitor=monitor)
    if module == "schedulefree":
        opt.train()  # the mode its step requires (it moves p)
    return opt


def _initial(kind: str, shape, gen: torch.Generator) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    return 0.02 * torch.randn(shape, generator=gen)


GRID = list(itertools.product(CASES, INITS, LRS))


def _truth(opt, named, before, grads):
    """:func:`truth.figures` after a step of ``opt``, silent where schedule-free RAdam's silent phase
    kept its lr at 0 by design (its ``scheduled_lr``, lr·rect with rect = 0; the lr itself not 0)."""
    group = opt.param_groups[0]
    silent = "silent_sgd_phase" in group and group["scheduled_lr"] == 0 and group["lr"] != 0
    return truth.figures(named, before, grads, silent)


def _step_beside_plain(opt, plain, named, plain_named, gen: torch.Generator, steps: int = STEPS,
                       cloned: bool | None = None) -> None:
    """``steps`` steps of the monitored ``opt`` and the ``plain`` one on the same random grads: each
    step's figures equal the clone truth and the parameters stay equal bit for bit; where ``cloned``
    is True (False), the view's ``before`` takes (takes no) clone of every parameter before each step."""
    for _ in range(steps):
        for (_, p), (_, q) in zip(named, plain_named):
            p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
            if cloned is not None:
                view = opt.monitor._engine.view
                assert isinstance(view.before(opt.param_groups[0], p, opt.state[p]), Cloned) == cloned
        before, grads = truth.snapshot(named)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        plain.step()
        assert all(re.search(HEALTH, str(w.message)) for w in caught), [str(w.message) for w in caught]
        truth.assert_figures_match(opt.monitor.latest, _truth(opt, named, before, grads))
        assert all(torch.equal(p, q) for (_, p), (_, q) in zip(named, plain_named))


@pytest.mark.parametrize("case,init,lr", GRID, ids=[f"{c}-{i}-{lr:g}" for c, i, lr in GRID])
def test_figures_equal_clone_truth_and_trajectory_is_the_plain_optimizers(case, init, lr, tmp_path):
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (64, 128), "b": (128,)}
    named = [(n, torch.nn.Parameter(_initial(init, s, gen))) for n, s in shapes.items()]
    plain_named = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
    opt = _build(case, named, lr, MonitorConfig(backend="none", logdir=tmp_path))
    plain = _build(case, plain_named, lr, None)
    assert type(opt.monitor._engine.view).__name__ == CASES[case][3]
    _step_beside_plain(opt, plain, named, plain_named, gen)
    assert_state_dicts_equal(opt.state_dict(), plain.state_dict())


def _logged_step(opt, named, gen: torch.Generator):
    """One step of ``opt`` on random grads, warning about nothing but :data:`HEALTH`: its figures (a
    copy of ``latest``) and the clones of the parameters and grads before it."""
    for _, p in named:
        p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
    before, grads = truth.snapshot(named)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert all(re.search(HEALTH, str(w.message)) for w in caught), [str(w.message) for w in caught]
    return dict(opt.monitor.latest), before, grads


@pytest.mark.parametrize("case", list(CASES))
def test_view_is_named_cuts_large_parameters_and_verifies(case, tmp_path):
    """A N(0, 0.02) matrix and one of more than PART_ELEMENTS elements: ``describe()`` names the view
    (in slices for the large one where the view is element-wise; else it gives ``Rows``), verify mode compares the
    view's update with a clone on every
    logging step and finds no miss, and the figures equal the clone truth."""
    gen = torch.Generator().manual_seed(1)
    named = [("w", torch.nn.Parameter(_initial("normal", (64, 128), gen))),
             ("big", torch.nn.Parameter(_initial("normal", (600, 500), gen)))]
    opt = _build(case, named, VERIFY_LR.get(case, 1e-3), MonitorConfig(backend="none", verify=True, logdir=tmp_path))
    rows = {line.split()[0]: line for line in opt.monitor.describe().splitlines()
            if line.split()[:1] in (["w"], ["big"])}
    view = CASES[case][3]
    sliced = rf"view \({view}\), in \d+ slices$" if opt.monitor._engine.view.elementwise else rf"view \({view}\)$"
    assert rows["w"].endswith(f"view ({view})") and re.search(sliced, rows["big"]), rows
    for _ in range(STEPS):
        latest, before, grads = _logged_step(opt, named, gen)
        assert latest.pop("verify/max_rel_error") < 1e-3  # below verify's own alarm (no warning either)
        truth.assert_figures_match({k: v for k, v in latest.items() if not k.startswith("verify/")},
                                   _truth(opt, named, before, grads))
    w = named[0][1]
    snapshot = opt.monitor._engine.view.before(opt.param_groups[0], w, opt.state[w])
    assert isinstance(snapshot, Cloned) == (case in CLONED)  # rebuilt, not cloned


@pytest.mark.parametrize("case", ["lion-pytorch", "optimizer-lion"])
def test_lion_signs_within_rounding_of_zero_take_a_clone(case, tmp_path):
    """Grads that cancel the momentum (c = lerp(m, g, 1-β1) within rounding of 0 on every element):
    the sign rebuilt from the stored momentum differs from the step's on some elements, so ``before``
    takes a clone of the parameter, and the figures still equal the clone truth."""
    gen = torch.Generator().manual_seed(2)
    named = [("w", torch.nn.Parameter(_initial("normal", (64, 128), gen)))]
    opt = _build(case, named, 1e-3, MonitorConfig(backend="none", logdir=tmp_path))
    w = named[0][1]
    w.grad = 1e-2 * torch.randn(w.shape, generator=gen)
    opt.step()
    beta1, beta2 = opt.param_groups[0]["betas"]
    m = opt.state[w]["exp_avg"]
    w.grad = m * (-beta1 / (1 - beta1))
    c = m.lerp(w.grad, 1 - beta1) if case == "optimizer-lion" else m.mul(beta1).add_(w.grad, alpha=1 - beta1)
    m_after = m.lerp(w.grad, 1 - beta2) if case == "optimizer-lion" else m.mul(beta2).add(w.grad, alpha=1 - beta2)
    rebuilt = (m_after.double() * beta1 + (beta2 - beta1) * w.grad.double()).sign()
    assert (rebuilt != c.sign()).sum() > 0  # the rebuild alone would be wrong here
    assert isinstance(opt.monitor._engine.view.before(opt.param_groups[0], w, opt.state[w]), Cloned)
    before, grads = truth.snapshot(named)
    opt.step()
    truth.assert_figures_match(opt.monitor.latest, _truth(opt, named, before, grads))


@pytest.mark.parametrize("name,kwargs", [("Adam8bit", {}), ("AdamW", dict(optim_bits=8)), ("SGD", dict(momentum=0.9)),
                                         ("AdEMAMix", {}), ("LAMB", dict(optim_bits=32))])
def test_bitsandbytes_optimizers_the_view_does_not_rebuild_are_measured_in_their_turn(name, kwargs, tmp_path):
    """Every bitsandbytes optimizer shares one ``step``: 8-bit state, a 1-state optimizer,
    AdEMAMix's three betas and LAMB (32-bit, with ``max_unorm``) are not rebuilt by the view (from the first step on:
    the bound view knows from the optimizer's settings that its state will not be 32-bit Adam's) but measured in
    their turn of the step (``updates/turns.py``: no clone), with figures equal to the clone truth and the plain
    optimizer's trajectory."""
    bnb = pytest.importorskip("bitsandbytes")
    gen = torch.Generator().manual_seed(3)
    named = [("w", torch.nn.Parameter(_initial("normal", (64, 128), gen)))]
    plain_named = [("w", torch.nn.Parameter(named[0][1].detach().clone()))]
    cls = getattr(bnb.optim, name)
    opt = Monitored(cls)(named, lr=1e-3, **kwargs, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    plain = cls(plain_named, lr=1e-3, **kwargs)
    assert type(opt.monitor._engine.view).__name__ == "BnbAdamView"
    _step_beside_plain(opt, plain, named, plain_named, gen, cloned=False)


def test_prodigy_keeps_two_numbers_and_sees_a_step_that_moved_nothing(tmp_path):
    """Prodigy's view keeps d and k of the group before the step (numbers, no tensor); a first step
    whose grads are all zero returns before moving p (k stays 0): no update, as the clone truth sees
    it; the next one moves p."""
    pytest.importorskip("prodigyopt")
    gen = torch.Generator().manual_seed(4)
    named = [("w", torch.nn.Parameter(_initial("normal", (64, 128), gen)))]
    opt = _build("prodigy-decoupled", named, 1.0, MonitorConfig(backend="none", logdir=tmp_path))
    w = named[0][1]
    for grad in (torch.zeros(w.shape), 1e-2 * torch.randn(w.shape, generator=gen)):
        w.grad = grad
        group = opt.param_groups[0]
        assert opt.monitor._engine.view.before(group, w, opt.state[w]) == (group["d"], group["k"])
        before, grads = truth.snapshot(named)
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, _truth(opt, named, before, grads))
        assert opt.monitor.latest["health/unchanged"] == float(not grad.any())
    assert opt.param_groups[0]["k"] == 1

def test_schedule_free_keeps_the_replayed_sums_where_its_rebuild_would_miss(tmp_path):
    """AdamWScheduleFree at lr 1e-6: its lerp towards z loses p_b's last bit on a share of the
    elements, a miss larger than MISS of the update's spread here, so ``before`` keeps the sums of the
    step replayed (no clone), and the figures equal the clone truth; the rebuild alone (as the
    capture would invert it) misses. The matrix spans several of the check's blocks
    (``CHECK_BLOCK``), whose sums are combined."""
    pytest.importorskip("schedulefree")
    from monitored_optim.updates import Summed

    gen = torch.Generator().manual_seed(5)
    named = [("w", torch.nn.Parameter(_initial("normal", (300, 500), gen)))]
    opt = _build("sf-adamw", named, 1e-6, MonitorConfig(backend="none", logdir=tmp_path))
    w, group = named[0][1], opt.param_groups[0]
    for _ in range(3):
        w.grad = 1e-2 * torch.randn(w.shape, generator=gen)
        summed = isinstance(opt.monitor._engine.view.before(group, w, opt.state[w]), Summed)
        before, grads = truth.snapshot(named)
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, _truth(opt, named, before, grads))
    assert summed  # the third step (w = 1/3)
    rebuilt = opt.monitor._engine.view.update(group, w, opt.state[w], None)
    stored = (w.detach() - (w.detach() - rebuilt)).double()  # the capture's p_a - fl(p_a - d)
    true = w.detach().double() - before["w"].double()
    assert (stored - true).norm() > 5e-5 * (true - true.mean()).norm()


@pytest.mark.parametrize("figures", ["verify", "all"])
def test_schedule_free_replayed_sums_under_verify_and_families_that_read_each_update(figures, tmp_path):
    """Verify mode checks the replayed sums' norm against its clone and finds no miss; the ``state``
    and ``spectral`` families, which read each part's update, get a clone of it instead of the sums;
    the figures equal the clone truth either way."""
    cls = pytest.importorskip("schedulefree").SGDScheduleFree
    gen = torch.Generator().manual_seed(11)
    named = [("w", torch.nn.Parameter(_initial("normal", (64, 128), gen)))]
    config = MonitorConfig(backend="none", logdir=tmp_path, verify=True) if figures == "verify" else \
        MonitorConfig(backend="none", logdir=tmp_path, figures="all")
    opt = Monitored(cls)(named, lr=1e-4, monitor=config)
    opt.train()
    for _ in range(4):
        latest, before, grads = _logged_step(opt, named, gen)
        if figures == "verify":
            assert latest.pop("verify/max_rel_error") < 1e-6
        core = ("update_norm/", "param_norm/", "grad_norm/", "update_to_data/", "grad_to_data/", "global/",
                "health/no_grad", "health/unchanged", "health/nonfinite", "health/skipped_steps",
                "health/withheld")
        truth.assert_figures_match({k: v for k, v in latest.items() if k.startswith(core)},
                                   _truth(opt, named, before, grads))


@pytest.mark.parametrize("case", [c for c in CASES if c not in CLONED])
@pytest.mark.parametrize("init", INITS)
def test_first_step_is_rebuilt_without_a_clone(case, init, tmp_path):
    """A parameter's first step, the state still empty: ``before`` keeps no copy of p (invariant 3
    holds on the first logging step too) and the figures equal the clone truth."""
    gen = torch.Generator().manual_seed(2)
    named = [("w", torch.nn.Parameter(_initial(init, (64, 128), gen)))]
    opt = _build(case, named, VERIFY_LR.get(case, 1e-3), MonitorConfig(backend="none", logdir=tmp_path))
    w = named[0][1]
    w.grad = 1e-2 * torch.randn(w.shape, generator=gen)
    assert not isinstance(opt.monitor._engine.view.before(opt.param_groups[0], w, opt.state[w]), Cloned)
    before, grads = truth.snapshot(named)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert all(re.search(HEALTH, str(w.message)) for w in caught), [str(w.message) for w in caught]
    truth.assert_figures_match(opt.monitor.latest, _truth(opt, named, before, grads))


@pytest.mark.parametrize("case", ["sf-adamw", "sf-sgd-wd", "sf-radam"])
def test_schedule_free_parameter_first_stepped_late_is_rebuilt(case, tmp_path):
    """A parameter without a grad on the first step gets its z on a later one (w < 1 there): its
    first step is still rebuilt from z_b = y_b, with no clone, and the figures equal the clone truth."""
    gen = torch.Generator().manual_seed(4)
    named = [(n, torch.nn.Parameter(_initial("normal", s, gen))) for n, s in (("w", (64, 128)), ("late", (32, 64)))]
    opt = _build(case, named, VERIFY_LR.get(case, 1e-3), MonitorConfig(backend="none", logdir=tmp_path))
    late = named[1][1]
    for step in range(3):
        for name, p in named:
            p.grad = None if (name == "late" and step == 0) else 1e-2 * torch.randn(p.shape, generator=gen)
        if step == 1:
            assert "z" not in opt.state[late] and opt.param_groups[0]["k"] == 1
            assert not isinstance(opt.monitor._engine.view.before(opt.param_groups[0], late, opt.state[late]), Cloned)
        before, grads = truth.snapshot(named)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert all(re.search(HEALTH + "|no gradient", str(w.message)) for w in caught), [str(w.message) for w in caught]
        truth.assert_figures_match(opt.monitor.latest, _truth(opt, named, before, grads))


def test_schedule_free_check_decides_alike_in_blocks_and_whole(monkeypatch, tmp_path):
    """The check before the step replays it a block at a time and combines the blocks' sums: its
    decision equals the one over the whole parameter at once, both ways (sums and rebuild), where
    the misses gather in one block."""
    pytest.importorskip("schedulefree")
    from monitored_optim.updates import Summed, _shared

    decided = {}
    for lr in (1e-6, 3e-6, 1e-5, 1e-3):
        gen = torch.Generator().manual_seed(6)
        named = [("w", torch.nn.Parameter(_initial("normal", (96, 100), gen)))]
        named[0][1].data[:10] = 1.0  # the first block's rows at 1.0, where the rebuild's misses gather
        opt = _build("sf-adamw", named, lr, MonitorConfig(backend="none", logdir=tmp_path))
        w, group, view = named[0][1], opt.param_groups[0], opt.monitor._engine.view
        for step in range(4):
            w.grad = 1e-2 * torch.randn(w.shape, generator=gen)
            lr_now = view.lr(group)
            weight = ((group["k"] + 1) ** group["r"]) * (max(lr_now, group["lr_max"]) ** group["weight_lr_power"])
            ratio = weight / (group["weight_sum"] + weight)
            fresh = "z" not in opt.state[w]
            for block in (1 << 30, 1000):  # one block; ten blocks, the last one short
                monkeypatch.setattr(_shared, "CHECK_BLOCK", block)
                decided.setdefault((lr, step), set()).add(
                    not isinstance(view.replayed(group, w, opt.state[w], ratio, lr_now, fresh), Summed))
            opt.step()
    assert all(len(d) == 1 for d in decided.values()), decided
    assert {d.pop() for d in decided.values()} == {True, False}


@pytest.mark.parametrize("case", list(CASES))
def test_empty_and_transposed_parameters(case, tmp_path):
    """An empty parameter and a transposed (non-contiguous) one beside a matrix: every step runs,
    the figures equal the clone truth, and the trajectory is the plain optimizer's."""
    gen = torch.Generator().manual_seed(7)
    shapes = {"w": (16, 24), "empty": (0,), "t": (24, 16)}

    def params():
        made = {n: _initial("normal", s, torch.Generator().manual_seed(8)) for n, s in shapes.items()}
        made["t"] = made["t"].t()
        return [(n, torch.nn.Parameter(t)) for n, t in made.items()]

    named, plain_named = params(), params()
    opt = _build(case, named, VERIFY_LR.get(case, 1e-3), MonitorConfig(backend="none", logdir=tmp_path))
    plain = _build(case, plain_named, VERIFY_LR.get(case, 1e-3), None)
    _step_beside_plain(opt, plain, named, plain_named, gen)


@pytest.mark.parametrize("attr,value", [("optim_bits", 8), ("max_unorm", 0.01)])
def test_bitsandbytes_args_changed_after_construction_are_measured_in_the_first_steps_turn(attr, value, tmp_path):
    """bitsandbytes reads ``opt.args`` when a parameter's first step creates its state, so a change of
    ``args`` after the optimizer is built (8-bit state, or LAMB-style ``max_unorm`` clipping) decides
    that step: the view asks the optimizer then, measures the parameter in its turn of the step
    (``updates/turns.py``) instead of rebuilding it, and the figures equal the clone truth."""
    bnb = pytest.importorskip("bitsandbytes")
    gen = torch.Generator().manual_seed(6)
    named = [("w", torch.nn.Parameter(_initial("normal", (64, 128), gen)))]
    plain_named = [("w", torch.nn.Parameter(named[0][1].detach().clone()))]
    monitor = MonitorConfig(backend="none", logdir=tmp_path)
    opt = Monitored(bnb.optim.AdamW)(named, lr=1e-3, optim_bits=32, monitor=monitor)
    plain = bnb.optim.AdamW(plain_named, lr=1e-3, optim_bits=32)
    setattr(opt.args, attr, value)
    setattr(plain.args, attr, value)
    named[0][1].grad = torch.zeros_like(named[0][1])
    assert isinstance(opt.monitor._engine.view.before(opt.param_groups[0], named[0][1], {}), Summed)  # not rebuilt
    _step_beside_plain(opt, plain, named, plain_named, gen, steps=1, cloned=False)


SF_RATES = [("SGDScheduleFree", lr, kwargs) for lr in (1.0, 1e-1, 1e-2, 1e-3)
            for kwargs in ({}, dict(weight_decay=1e-2, warmup_steps=3))] + \
           [("RAdamScheduleFree", lr, kwargs) for lr in (1e-3, 1e-4) for kwargs in ({}, dict(weight_decay=1e-2))] + \
           [("SGDScheduleFree", 1e-7, {}), ("RAdamScheduleFree", 1e-7, {})]
"""Schedule-free SGD and RAdam at the learning rates people use (SGD 1.0 down to 1e-3, RAdam 1e-3 and
1e-4; a warmup's 1e-7), with and without weight decay and warmup."""


@pytest.mark.parametrize("name,lr,kwargs", SF_RATES,
                         ids=[f"{n[:5]}-{lr:g}{'-wd' if k else ''}" for n, lr, k in SF_RATES])
def test_schedule_free_sgd_and_radam_take_no_copy_of_a_matrix(name, lr, kwargs, tmp_path):
    """Over 8 steps (RAdam's silent first 4 and its first rectified step included), ``before`` takes
    no clone of the N(0, 0.02) matrix (nor of the vectors), though its lerp towards z loses p_b's last bit on a share of
    the elements; the figures of the matrix, a LayerNorm weight at 1.0 and a bias at 0 equal the
    clone truth, and the trajectory is the plain optimizer's bit for bit."""
    cls = getattr(pytest.importorskip("schedulefree"), name)
    gen = torch.Generator().manual_seed(9)
    shapes = {"w": ("normal", (64, 128)), "ln": ("ones", (128,)), "b": ("zeros", (128,))}
    named = [(n, torch.nn.Parameter(_initial(kind, s, gen))) for n, (kind, s) in shapes.items()]
    plain_named = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
    opt = Monitored(cls)(named, lr=lr, **kwargs, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    plain = cls(plain_named, lr=lr, **kwargs)
    opt.train(), plain.train()
    _step_beside_plain(opt, plain, named, plain_named, gen, steps=8, cloned=False)
    assert_state_dicts_equal(opt.state_dict(), plain.state_dict())


@pytest.mark.parametrize("foreach", [True, False])
def test_schedule_free_figures_from_the_replay_are_the_steps_to_the_last_bit(foreach, tmp_path):
    """Where the rebuild would miss (schedule-free SGD at lr 1e-4 from its third step on, w = 1/3),
    ``before`` keeps the sums of the step replayed (``Summed``): the same arithmetic as the step's own
    (foreach or not), so the update's norm equals the clone truth's to float64 rounding, not only to
    1e-4."""
    from monitored_optim.updates import Summed

    cls = pytest.importorskip("schedulefree").SGDScheduleFree
    gen = torch.Generator().manual_seed(10)
    named = [("w", torch.nn.Parameter(_initial("normal", (300, 500), gen)))]
    opt = Monitored(cls)(named, lr=1e-4, foreach=foreach, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    opt.train()
    w = named[0][1]
    for step in range(4):
        w.grad = 1e-2 * torch.randn(w.shape, generator=gen)
        summed = isinstance(opt.monitor._engine.view.before(opt.param_groups[0], w, opt.state[w]), Summed)
        before, grads = truth.snapshot(named)
        opt.step()
        want = _truth(opt, named, before, grads)["update_norm/w"]
        assert summed == (step >= 2), step  # the rebuild serves w = 1 and w = 1/2 (z_b = y_b)
        if summed:
            assert abs(opt.monitor.latest["update_norm/w"] - want) <= 1e-12 * want, step

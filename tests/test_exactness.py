"""Every built-in optimizer and its main flags: logged figures equal a clone-based truth computed
here, and the trajectory and state_dict() equal the plain optimizer's bit for bit."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import models
import truth
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.updates import CLONE, Cloned, view_for

O = torch.optim
T = torch.tensor

# (id, optimizer class, kwargs, problem factory)
CASES = [
    ("sgd", O.SGD, dict(lr=0.05), models.mlp),
    ("sgd-wd", O.SGD, dict(lr=0.05, weight_decay=0.01), models.mlp),
    ("sgd-momentum", O.SGD, dict(lr=0.05, momentum=0.9), models.mlp),
    ("sgd-dampening", O.SGD, dict(lr=0.05, momentum=0.9, dampening=0.5, weight_decay=0.01), models.mlp),
    ("sgd-nesterov", O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), models.mlp),
    ("sgd-nesterov-wd", O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), models.mlp),
    ("sgd-nesterov-foreach", O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, foreach=True), models.mlp),
    ("sgd-nesterov-foreach-wd", O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, foreach=True,
                                            weight_decay=0.01), models.mlp),
    ("sgd-nesterov-maximize-foreach", O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True,
                                                  foreach=True), models.mlp),
    ("sgd-maximize-wd", O.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01, maximize=True), models.mlp),
    ("sgd-foreach", O.SGD, dict(lr=0.05, momentum=0.9, foreach=True), models.mlp),
    ("sgd-fused", O.SGD, dict(lr=0.05, momentum=0.9, fused=True), models.mlp),
    ("sgd-fused-nesterov", O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, fused=True), models.mlp),
    ("sgd-tensor-lr", O.SGD, dict(lr=T(0.05), momentum=0.9), models.mlp),
    ("sgd-tensor-lr-plain", O.SGD, dict(lr=T(0.05), weight_decay=0.01), models.mlp),
    ("adam", O.Adam, dict(lr=1e-2), models.mlp),
    ("adam-amsgrad", O.Adam, dict(lr=1e-2, amsgrad=True), models.mlp),
    ("adam-l2", O.Adam, dict(lr=1e-2, weight_decay=0.1), models.mlp),
    ("adam-decoupled", O.Adam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), models.mlp),
    ("adam-maximize", O.Adam, dict(lr=1e-2, maximize=True, amsgrad=True), models.mlp),
    ("adam-foreach", O.Adam, dict(lr=1e-2, foreach=True, weight_decay=0.1), models.mlp),
    ("adam-single", O.Adam, dict(lr=1e-2, foreach=False), models.mlp),
    ("adam-fused", O.Adam, dict(lr=1e-2, fused=True, amsgrad=True), models.mlp),
    ("adam-tensor-lr", O.Adam, dict(lr=T(1e-2), foreach=False), models.mlp),
    ("adam-tensor-betas", O.Adam, dict(lr=1e-2, betas=(T(0.9), T(0.99)), foreach=False), models.mlp),
    ("adamw", O.AdamW, dict(lr=1e-2), models.mlp),
    ("adamw-amsgrad-wd", O.AdamW, dict(lr=1e-2, amsgrad=True, weight_decay=0.3), models.mlp),
    ("adamw-foreach", O.AdamW, dict(lr=1e-2, foreach=True), models.mlp),
    ("adamw-fused", O.AdamW, dict(lr=1e-2, fused=True), models.mlp),
    ("adamw-tensor-lr", O.AdamW, dict(lr=T(1e-2), foreach=False), models.mlp),
    ("adamax", O.Adamax, dict(lr=1e-2), models.mlp),
    ("adamax-wd-maximize", O.Adamax, dict(lr=1e-2, weight_decay=0.1, maximize=True), models.mlp),
    ("adamax-foreach", O.Adamax, dict(lr=1e-2, foreach=True), models.mlp),
    ("adamax-single-wd-betas", O.Adamax, dict(lr=1e-2, weight_decay=0.1, betas=(0.5, 0.9), eps=1e-3,
                                              foreach=False), models.mlp),
    ("adamax-foreach-wd-maximize", O.Adamax, dict(lr=1e-2, weight_decay=0.1, maximize=True, foreach=True), models.mlp),
    ("adamax-tensor-lr", O.Adamax, dict(lr=T(1e-2), foreach=False), models.mlp),
    ("adamax-tensor-lr-foreach", O.Adamax, dict(lr=T(1e-2), foreach=True), models.mlp),
    ("adagrad", O.Adagrad, dict(lr=0.05), models.mlp),
    ("adagrad-lr-decay", O.Adagrad, dict(lr=0.05, lr_decay=0.1, initial_accumulator_value=0.1), models.mlp),
    ("adagrad-wd-foreach", O.Adagrad, dict(lr=0.05, weight_decay=0.1, foreach=True), models.mlp),
    ("adagrad-fused", O.Adagrad, dict(lr=0.05, fused=True), models.mlp),
    ("adagrad-wd", O.Adagrad, dict(lr=0.05, weight_decay=0.1, foreach=False), models.mlp),
    ("adagrad-wd-init", O.Adagrad, dict(lr=0.05, weight_decay=0.1, initial_accumulator_value=1.0), models.mlp),
    ("adagrad-maximize-foreach", O.Adagrad, dict(lr=0.05, lr_decay=0.1, maximize=True, foreach=True), models.mlp),
    ("adagrad-fused-wd-maximize", O.Adagrad, dict(lr=0.05, lr_decay=0.1, weight_decay=0.1, eps=1e-3, maximize=True,
                                                  initial_accumulator_value=1.0, fused=True), models.mlp),
    ("adagrad-tensor-lr", O.Adagrad, dict(lr=T(0.05), lr_decay=0.1, foreach=False), models.mlp),
    ("adagrad-tensor-lr-foreach", O.Adagrad, dict(lr=T(0.05), lr_decay=0.1, foreach=True), models.mlp),
    ("adagrad-tensor-lr-fused", O.Adagrad, dict(lr=T(0.05), lr_decay=0.1, fused=True), models.mlp),
    ("adagrad-tensor-lr-wd", O.Adagrad, dict(lr=T(0.05), weight_decay=0.1, initial_accumulator_value=1.0,
                                             foreach=False), models.mlp),
    ("adagrad-sparse", O.Adagrad, dict(lr=0.05, lr_decay=0.1, initial_accumulator_value=0.1), models.embeddings),
    ("adagrad-sparse-maximize-foreach", O.Adagrad, dict(lr=0.05, maximize=True, foreach=True), models.embeddings),
    ("adadelta", O.Adadelta, dict(lr=1.0), models.mlp),
    ("adadelta-wd-maximize", O.Adadelta, dict(lr=1.0, weight_decay=0.1, maximize=True), models.mlp),
    ("adadelta-foreach", O.Adadelta, dict(lr=1.0, foreach=True), models.mlp),
    ("adadelta-single-maximize", O.Adadelta, dict(lr=1.0, rho=0.5, eps=1e-4, maximize=True, foreach=False), models.mlp),
    ("adadelta-foreach-maximize", O.Adadelta, dict(lr=0.5, maximize=True, foreach=True), models.mlp),
    ("adadelta-wd-foreach", O.Adadelta, dict(lr=1.0, weight_decay=0.1, foreach=True), models.mlp),
    ("adadelta-tensor-lr", O.Adadelta, dict(lr=T(1.0), foreach=False), models.mlp),
    ("adadelta-tensor-lr-foreach", O.Adadelta, dict(lr=T(1.0), foreach=True), models.mlp),
    ("rmsprop", O.RMSprop, dict(lr=1e-2), models.mlp),
    ("rmsprop-centered", O.RMSprop, dict(lr=1e-2, centered=True), models.mlp),
    ("rmsprop-momentum-wd", O.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True, weight_decay=0.1), models.mlp),
    ("rmsprop-foreach", O.RMSprop, dict(lr=1e-2, foreach=True, maximize=True), models.mlp),
    ("rmsprop-single-alpha", O.RMSprop, dict(lr=1e-2, alpha=0.9, eps=1e-4, maximize=True, foreach=False), models.mlp),
    ("rmsprop-wd", O.RMSprop, dict(lr=1e-2, weight_decay=0.1, foreach=False), models.mlp),
    ("rmsprop-wd-centered-foreach", O.RMSprop, dict(lr=1e-2, weight_decay=0.1, centered=True, maximize=True,
                                                    foreach=True), models.mlp),
    ("rmsprop-wd-small", O.RMSprop, dict(lr=1e-3, weight_decay=1e-4, alpha=0.9), models.mlp),
    ("rmsprop-momentum", O.RMSprop, dict(lr=1e-2, momentum=0.9, foreach=False), models.mlp),
    ("rmsprop-momentum-foreach", O.RMSprop, dict(lr=1e-2, momentum=0.5, weight_decay=0.1, maximize=True,
                                                 foreach=True), models.mlp),
    ("rmsprop-tensor-lr", O.RMSprop, dict(lr=T(1e-2), centered=True, foreach=False), models.mlp),
    ("rmsprop-tensor-lr-foreach", O.RMSprop, dict(lr=T(1e-2), momentum=0.9, foreach=True), models.mlp),
    ("rmsprop-tensor-lr-wd", O.RMSprop, dict(lr=T(1e-3), weight_decay=1e-2, foreach=False), models.mlp),
    ("rprop", O.Rprop, dict(lr=1e-2), models.mlp),
    ("rprop-foreach-maximize", O.Rprop, dict(lr=1e-2, foreach=True, maximize=True), models.mlp),
    ("rprop-single-maximize", O.Rprop, dict(lr=1e-2, maximize=True, foreach=False), models.mlp),
    ("rprop-etas", O.Rprop, dict(lr=1e-2, etas=(0.3, 1.5), step_sizes=(1e-3, 1.5e-2), foreach=False), models.mlp),
    ("rprop-etas-foreach", O.Rprop, dict(lr=1e-2, etas=(0.3, 1.5), step_sizes=(1e-3, 1.5e-2), foreach=True),
     models.mlp),
    ("rprop-tensor-lr", O.Rprop, dict(lr=T(1e-2), foreach=False), models.mlp),
    ("rprop-tensor-lr-foreach", O.Rprop, dict(lr=T(1e-2), foreach=True), models.mlp),
    ("nadam", O.NAdam, dict(lr=1e-2), models.mlp),
    ("nadam-l2", O.NAdam, dict(lr=1e-2, weight_decay=0.1), models.mlp),
    ("nadam-decoupled-foreach", O.NAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True,
                                              foreach=True), models.mlp),
    ("nadam-foreach", O.NAdam, dict(lr=1e-2, foreach=True), models.mlp),
    ("nadam-single-decoupled", O.NAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True,
                                             foreach=False), models.mlp),
    ("nadam-l2-foreach-maximize", O.NAdam, dict(lr=1e-2, weight_decay=0.1, maximize=True, foreach=True), models.mlp),
    ("nadam-momentum-decay", O.NAdam, dict(lr=1e-2, momentum_decay=0.05, betas=(0.8, 0.99), eps=1e-6,
                                           maximize=True), models.mlp),
    ("nadam-tensor-lr", O.NAdam, dict(lr=T(1e-2), foreach=False), models.mlp),
    ("nadam-tensor-lr-foreach", O.NAdam, dict(lr=T(1e-2), foreach=True), models.mlp),
    ("nadam-tensor-lr-l2", O.NAdam, dict(lr=T(1e-2), weight_decay=0.1, foreach=False), models.mlp),
    ("nadam-tensor-lr-decoupled-foreach", O.NAdam, dict(lr=T(1e-2), weight_decay=0.1, decoupled_weight_decay=True,
                                                        foreach=True), models.mlp),
    ("radam", O.RAdam, dict(lr=1e-2), models.mlp),
    ("radam-decoupled", O.RAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), models.mlp),
    ("radam-foreach", O.RAdam, dict(lr=1e-2, foreach=True), models.mlp),
    ("radam-single", O.RAdam, dict(lr=1e-2, foreach=False), models.mlp),
    ("radam-l2-maximize", O.RAdam, dict(lr=1e-2, weight_decay=0.1, maximize=True), models.mlp),
    ("radam-l2-foreach-maximize", O.RAdam, dict(lr=1e-2, weight_decay=0.1, maximize=True, foreach=True), models.mlp),
    ("radam-decoupled-foreach", O.RAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True,
                                              foreach=True), models.mlp),
    ("radam-betas", O.RAdam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6), models.mlp),
    ("radam-tensor-lr", O.RAdam, dict(lr=T(1e-2), foreach=False), models.mlp),
    ("radam-tensor-lr-foreach", O.RAdam, dict(lr=T(1e-2), foreach=True), models.mlp),
    ("radam-tensor-lr-decoupled", O.RAdam, dict(lr=T(1e-2), weight_decay=0.1, decoupled_weight_decay=True,
                                                foreach=False), models.mlp),
    ("radam-tensor-lr-decoupled-foreach", O.RAdam, dict(lr=T(1e-2), weight_decay=0.1, decoupled_weight_decay=True,
                                                        foreach=True), models.mlp),
    ("asgd", O.ASGD, dict(lr=1e-2), models.mlp),
    ("asgd-wd-foreach", O.ASGD, dict(lr=1e-2, weight_decay=0.1, foreach=True), models.mlp),
    ("asgd-single-wd-maximize", O.ASGD, dict(lr=1e-2, weight_decay=0.1, maximize=True, foreach=False), models.mlp),
    ("asgd-lambd", O.ASGD, dict(lr=5e-2, lambd=0.1, alpha=0.5, t0=2, foreach=False), models.mlp),
    ("asgd-lambd-foreach", O.ASGD, dict(lr=5e-2, lambd=0.1, alpha=0.5, t0=2, maximize=True, foreach=True), models.mlp),
    ("asgd-tensor-lr", O.ASGD, dict(lr=T(1e-2), lambd=0.1, foreach=False), models.mlp),
    ("asgd-tensor-lr-foreach", O.ASGD, dict(lr=T(1e-2), lambd=0.1, foreach=True), models.mlp),
    ("sparse-adam", O.SparseAdam, dict(lr=1e-2), models.embeddings),
    ("sparse-adam-maximize", O.SparseAdam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, maximize=True),
     models.embeddings),
    ("sparse-adam-tensor-lr", O.SparseAdam, dict(lr=T(1e-2)), models.embeddings),
    ("adafactor", O.Adafactor, dict(lr=1e-2), models.mlp),
    ("adafactor-wd-foreach", O.Adafactor, dict(lr=1e-2, weight_decay=0.1, foreach=True), models.mlp),
    ("adafactor-foreach", O.Adafactor, dict(lr=1e-2, foreach=True), models.mlp),
    ("adafactor-wd-maximize", O.Adafactor, dict(lr=1e-2, weight_decay=0.1, maximize=True), models.mlp),
    ("adafactor-decay-d-eps", O.Adafactor, dict(lr=1e-2, beta2_decay=-0.5, d=1.1, eps=(1e-20, 1e-2)), models.mlp),
    ("adafactor-eps2-foreach-maximize", O.Adafactor, dict(lr=1e-2, eps=(1e-3, 0.5), maximize=True, foreach=True),
     models.mlp),
    ("adafactor-relative-step", O.Adafactor, dict(lr=1.0, weight_decay=0.01), models.mlp),
    ("adafactor-tensor-lr-wd", O.Adafactor, dict(lr=T(1e-2), weight_decay=0.1), models.mlp),
    ("adafactor-tensor-lr-foreach", O.Adafactor, dict(lr=T(1e-2), weight_decay=0.1, foreach=True), models.mlp),
    ("muon", O.Muon, dict(lr=2e-2), lambda dtype: models.mlp(dtype, bias=False)),
    ("muon-no-nesterov", O.Muon, dict(lr=2e-2, nesterov=False, weight_decay=0.0),
     lambda dtype: models.mlp(dtype, bias=False)),
    ("muon-match-rms-adamw", O.Muon, dict(lr=2e-2, adjust_lr_fn="match_rms_adamw", ns_steps=3, momentum=0.9,
                                          weight_decay=0.3), lambda dtype: models.mlp(dtype, bias=False)),
    ("muon-original-coefficients", O.Muon, dict(lr=2e-2, adjust_lr_fn="original", ns_coefficients=(3.0, -3.2, 1.2),
                                                eps=1e-5, nesterov=False), lambda dtype: models.mlp(dtype, bias=False)),
    ("muon-tensor-lr", O.Muon, dict(lr=T(2e-2)), lambda dtype: models.mlp(dtype, bias=False)),
    ("lbfgs", O.LBFGS, dict(lr=0.5, max_iter=3), lambda dtype: models.mlp(dtype, two_groups=False)),
    ("lbfgs-wolfe", O.LBFGS, dict(lr=1.0, max_iter=4, line_search_fn="strong_wolfe"),
     lambda dtype: models.mlp(dtype, two_groups=False)),
]

STATE_AWARE = {O.SGD, O.Adam, O.AdamW, O.Adamax, O.Adagrad, O.Adadelta, O.RMSprop, O.Rprop, O.ASGD,
               O.NAdam, O.RAdam, O.SparseAdam, O.Adafactor, O.Muon}
"""Optimizers whose figures come from a state-aware view (no clone); the rest use the clone fallback."""

TOLERANCE = {torch.float32: dict(ratio_tol=2e-3, norm_rtol=1e-4),
             torch.float64: dict(ratio_tol=1e-6 / math.log(10), norm_rtol=1e-6)}
"""fp32: log10 ratios within 2e-3, norms within 1e-4 relative; fp64: both within 1e-6 relative."""

STEPS = 4

CASE_STEPS = {cid: 7 for cid, cls, _, _ in CASES if cls is O.RAdam}
"""Cases that need more steps: RAdam is unrectified for t <= 5 (ρ_t <= 5) and rectified from t = 6."""


def _groups(problem, kwargs):
    """Second group with half the lr (where the optimizer has a float lr) to prove per-group reads."""
    groups = [{**g, "params": list(g["params"])} for g in problem.groups]
    if len(groups) > 1 and isinstance(kwargs.get("lr"), float):
        groups[1] = {**groups[1], "lr": kwargs["lr"] / 2}
    return groups


def train(cls, kwargs, factory, dtype, monitor=None, check=None, steps=STEPS):
    """Run ``steps`` steps; with ``check``, compare each step's logged figures against the clone truth."""
    problem = factory(dtype)
    extra = {} if monitor is None else {"monitor": monitor}
    opt = cls(_groups(problem, dict(kwargs)), **{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                                  for k, v in kwargs.items()}, **extra)
    closure_based = issubclass(cls, O.LBFGS)
    for i in range(steps):
        closure = problem.closure(opt, i)
        closure()
        before, grads = truth.snapshot(problem.named)
        if closure_based:
            opt.step(closure)
        else:
            opt.step()
        if check is not None:
            check(opt, truth.figures(problem.named, before, grads))
    return problem, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("cid,cls,kwargs,factory", CASES, ids=[c[0] for c in CASES])
def test_figures_equal_clone_truth_and_trajectory_is_bitwise(cid, cls, kwargs, factory, dtype, tmp_path):
    seen = []
    assert (view_for(cls) is not CLONE) == (cls in STATE_AWARE)

    def check(opt, expected):
        truth.assert_figures_match(opt.monitor.latest, expected, **TOLERANCE[dtype])
        for i, group in enumerate(opt.param_groups):
            assert opt.monitor.latest[f"lr/group{i}"] == pytest.approx(float(group["lr"]), rel=1e-12)
        seen.append(opt.monitor.step)

    steps = CASE_STEPS.get(cid, STEPS)
    plain_problem, plain = train(cls, kwargs, factory, dtype, steps=steps)
    mon_problem, mon = train(Monitored(cls), kwargs, factory, dtype,
                             monitor=MonitorConfig(backend="none", logdir=tmp_path), check=check, steps=steps)
    assert seen == list(range(1, steps + 1))
    for (name, a), (_, b) in zip(plain_problem.named, mon_problem.named):
        assert torch.equal(a, b), name
    assert_state_dicts_equal(plain.state_dict(), mon.state_dict())


LR_CHANGES = [
    ("asgd", O.ASGD, dict(lr=5e-2)),
    ("asgd-wd-foreach", O.ASGD, dict(lr=5e-2, lambd=0.1, weight_decay=0.1, foreach=True)),
    ("asgd-tensor-lr", O.ASGD, dict(lr=T(5e-2), lambd=0.1, foreach=False)),
    ("adagrad-lr-decay", O.Adagrad, dict(lr=0.05, lr_decay=0.1, initial_accumulator_value=1.0, weight_decay=0.1)),
    ("adamax", O.Adamax, dict(lr=1e-2)),
    ("adadelta", O.Adadelta, dict(lr=1.0)),
    ("rmsprop-wd", O.RMSprop, dict(lr=1e-2, weight_decay=0.1)),
    ("rprop", O.Rprop, dict(lr=1e-2)),
]
"""Cases whose lr changes between steps, as under a scheduler. ASGD's step uses the η that the
previous step derived from the previous lr, so its view must not read the current lr."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("cid,cls,kwargs", LR_CHANGES, ids=[c[0] for c in LR_CHANGES])
def test_figures_equal_clone_truth_when_lr_changes_between_steps(cid, cls, kwargs, dtype, tmp_path):
    def decay(opt, expected=None):
        for group in opt.param_groups:
            group["lr"] = group["lr"] * 0.5

    def check(opt, expected):
        truth.assert_figures_match(opt.monitor.latest, expected, **TOLERANCE[dtype])
        decay(opt)

    plain_problem, _ = train(cls, kwargs, models.mlp, dtype, check=decay)
    mon_problem, _ = train(Monitored(cls), kwargs, models.mlp, dtype,
                           monitor=MonitorConfig(backend="none", logdir=tmp_path), check=check)
    for (name, a), (_, b) in zip(plain_problem.named, mon_problem.named):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("cls,kwargs,p0,ill", [
    (O.Adagrad, dict(lr=0.05, weight_decay=0.1), 0.05, True),  # first step: D = |λ·p| ≈ lr·λ where |p| ≈ lr
    (O.Adagrad, dict(lr=0.05, weight_decay=0.1, initial_accumulator_value=1.0), 0.05, False),  # D ≥ 1
    (O.RMSprop, dict(lr=0.05, weight_decay=0.1), 0.5, True),  # first step: D = sqrt(1-α)·|λ·p|
    (O.RMSprop, dict(lr=0.05, weight_decay=0.1, centered=True), 0.5, True),
    (O.RMSprop, dict(lr=0.05, weight_decay=0.1), 5.0, False),  # D ≈ 10·lr·λ
], ids=["adagrad-ill", "adagrad-well", "rmsprop-ill", "rmsprop-centered-ill", "rmsprop-well"])
def test_weight_decay_solve_takes_a_clone_where_ill_conditioned(cls, kwargs, p0, ill, dtype, tmp_path):
    """With λ > 0 the rebuild divides by D - lr·λ. Tiny grads and |p| within 1e-5 of p0 put it at
    ~1e-5·D, where the bare solve loses the update (wrong or non-finite figures): ``before`` takes a
    clone and the figures stay true. A well-conditioned parameter (|p| = p0 ± 20 %) is never cloned."""
    torch.manual_seed(0)
    spread = 1e-5 if ill else 0.2
    p = torch.nn.Parameter((p0 * (1 + spread * torch.randn(64)) * torch.randn(64).sign()).to(dtype))
    opt = Monitored(cls)([("w", p)], monitor=MonitorConfig(backend="none", logdir=tmp_path), **kwargs)
    cloned = []
    for _ in range(3):
        p.grad = 1e-6 * torch.randn_like(p)
        cloned.append(isinstance(view_for(cls).before(opt.param_groups[0], p, opt.state[p]), Cloned))
        before, grads = truth.snapshot([("w", p)])
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, truth.figures([("w", p)], before, grads), **TOLERANCE[dtype])
    assert cloned[0] if ill else not any(cloned)


@pytest.mark.parametrize("cls", [O.Adamax, O.Adagrad, O.Adadelta, O.RMSprop, O.Rprop, O.ASGD])
def test_differentiable_groups_take_the_clone(cls):
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    opt = cls([p], differentiable=True)
    assert isinstance(view_for(cls).before(opt.param_groups[0], p, opt.state[p]), Cloned)


def assert_state_dicts_equal(a, b):
    """Bitwise equality of two optimizer state dicts (tensors by torch.equal, the rest by ==)."""
    assert a["param_groups"] == b["param_groups"] or _groups_equal(a["param_groups"], b["param_groups"])
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        _assert_equal(a["state"][k], b["state"][k])


def _groups_equal(ga, gb):
    for x, y in zip(ga, gb, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            _assert_equal(x[k], y[k])
    return True


def _assert_equal(x, y):
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    elif isinstance(x, dict):
        assert x.keys() == y.keys()
        for k in x:
            _assert_equal(x[k], y[k])
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y)
        for xi, yi in zip(x, y):
            _assert_equal(xi, yi)
    else:
        assert x == y


def _wide(dtype=torch.float32) -> models.Problem:
    """Three 600x600 layers (1.4 MB each in fp32, so a logging step rebuilds the updates in several
    chunks) with biases, one float64 layer in the same group, and ``gated``, which gets a grad on odd
    batches only, so that its Adam step count lags behind the others'."""
    torch.manual_seed(0)
    model = nn.ModuleDict({f"fc{i}": nn.Linear(600, 600).to(dtype) for i in range(3)})
    model["gated"] = nn.Linear(600, 8).to(dtype)
    model["fine"] = nn.Linear(8, 4).double()
    xs, ys = torch.randn(6, 4, 600, dtype=dtype), torch.randn(6, 4, 600, dtype=dtype)
    zs = torch.randn(6, 2, 8, dtype=torch.float64)

    def loss(i: int) -> torch.Tensor:
        h = xs[i % 6]
        for k in range(3):
            h = torch.tanh(model[f"fc{k}"](h))
        out = (h - ys[i % 6]).pow(2).mean() + (model["gated"](h).pow(2).mean() if i % 2 else 0.0)
        return out + model["fine"](zs[i % 6]).pow(2).mean().to(dtype)

    return models.Problem(model, [{"params": list(model.named_parameters())}], loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("cls,kwargs", [
    (O.Adam, dict(lr=1e-3)),
    (O.AdamW, dict(lr=1e-3, weight_decay=0.1, amsgrad=True)),
    (O.Adam, dict(lr=T(1e-3), betas=(T(0.9), T(0.99)), foreach=False)),
    (O.SGD, dict(lr=1e-2, momentum=0.9)),
], ids=["adam", "adamw-amsgrad", "adam-tensor-hyper", "sgd-momentum"])
def test_chunks_mixed_dtypes_and_lagging_steps_equal_clone_truth(cls, kwargs, dtype, tmp_path):
    """Updates rebuilt a chunk at a time (``update_many``), a float64 parameter among float32 ones,
    and per-parameter Adam steps that differ within a group: figures equal the clone truth at every
    step, the trajectory is bitwise the plain optimizer's, and the chunks really split the group."""
    from monitored_optim.capture import change, eager, plan

    problem = _wide(dtype)
    entries = [plan.Entry(n, {}, p, None) for n, p in problem.named]
    budget = change.budget(sum(p.numel() * p.element_size() for _, p in problem.named))
    assert len(list(eager.chunks(entries, budget))) >= 3

    def check(opt, expected):
        truth.assert_figures_match(opt.monitor.latest, expected, **TOLERANCE[dtype])

    plain_problem, _ = train(cls, kwargs, _wide, dtype, steps=5)
    mon_problem, mon = train(Monitored(cls), kwargs, _wide, dtype, steps=5, check=check,
                             monitor=MonitorConfig(backend="none", logdir=tmp_path))
    if cls is not O.SGD:
        steps = {n: int(mon.state[p]["step"]) for n, p in mon_problem.named}
        assert steps["gated.weight"] == 2 and steps["fc0.weight"] == 5
    for (name, a), (_, b) in zip(plain_problem.named, mon_problem.named):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("factory", ["lion_pytorch", "sgd"])
def test_an_update_whose_mean_jumps_far_above_its_spread_is_exact_at_the_jump(factory):
    """Steps 1-4 move elements by random signs (their update's mean is small next to its spread, so
    the next one takes no centred pass); step 5's grads all agree, and the update is nearly one value
    for every element (Lion's sign step plus a weight decay of 0.05 * p, or SGD's of a constant grad
    with a little noise): its ratio, about -5.3, is logged at step 5 and equals the truth's. The grad
    jumps the same way: its ratio (undefined for Lion's constant grad) is withheld at step 5 and
    counted (``health/withheld``), then sent, exact, from step 6 on where it is defined."""
    if factory == "lion_pytorch":
        lion = pytest.importorskip("lion_pytorch")
        cls, kwargs = lion.Lion, {"lr": 1e-4, "weight_decay": 0.05}
    else:
        cls, kwargs = torch.optim.SGD, {"lr": 1e-4}
    torch.manual_seed(0)
    p = nn.Parameter(1 + 0.1 * torch.randn(300_000))  # large enough for the eager capture
    named = [("norm.weight", p)]
    opt = Monitored(cls)(named, **kwargs, monitor=MonitorConfig(backend="none", every=1))
    for step in range(1, 7):
        p.grad = torch.randn(300_000) if step < 5 else 100.0 + (factory == "sgd") * 1e-3 * torch.randn(300_000)
        before, grads = truth.snapshot(named)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.step()
        # the grad's jump is a spike in its norm, which the spikes family tells once it has 5 values
        assert [str(w.message)[:49] for w in seen] == (["monitored_optim: spike at step 6 in 'norm.weight'"]
                                                        if step == 6 else [])
        expected = truth.figures(named, before, grads)
        assert expected["update_to_data/norm.weight"] < -4 or step < 5
        if step == 5:
            expected.pop("grad_to_data/norm.weight", None)
            expected["health/withheld"] = 1.0
        truth.assert_figures_match(opt.monitor.latest, expected)

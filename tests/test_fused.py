"""The fused capture (``MonitorConfig(compile=True)``): the same figures as the clone truth, the
trajectory of the plain optimizer, and a logging step whose dispatched ops do not grow with the
number of tensors."""

from __future__ import annotations

import collections
import math
import warnings

import pytest
import torch
from torch import nn

import truth
from monitored_optim import Monitored, MonitorConfig
from test_exact_grid import CASES, check_case

FP32 = [c for c in CASES if c[0] == "fp32"]


@pytest.mark.parametrize("dtype,init,opt_id,lr", FP32, ids=[f"{d}-{i}-{o}-{lr:g}" for d, i, o, lr in FP32])
def test_fused_capture_equals_clone_truth_on_the_grid(dtype, init, opt_id, lr, tmp_path):
    """The float32 half of the exact-figures grid (the fused path takes float32/float64 only)."""
    check_case(dtype, init, opt_id, lr, tmp_path, compile=True)


class Block(nn.Module):
    """Pre-norm MLP block: LayerNorm (gain 1.0, bias 0), two Linear layers with zero biases."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        for layer in (self.up, self.down):
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


WIDTH = 48
"""Each block's matrices have 48 x 96 = 4,608 elements, above the flat capture's 4,096: the fused
capture rebuilds them, while the LayerNorm gains and biases are copied flat."""


def net(blocks: int, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)], nn.Linear(width, 4))


SETUPS = {
    "adamw-warmup": (torch.optim.AdamW, dict(lr=1e-7, weight_decay=0.1)),
    "adam-l2": (torch.optim.Adam, dict(lr=1e-3, weight_decay=1e-2, amsgrad=True)),
    "sgd-momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)),
    "sgd-maximize": (torch.optim.SGD, dict(lr=1e-3, maximize=True)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-4)),
}


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, check: bool) -> None:
    named = list(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, WIDTH, generator=gen)).square().mean().backward()
        before, grads = truth.snapshot(named)
        opt.step()
        if check:
            truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))


@pytest.mark.parametrize("setup", SETUPS)
def test_fused_capture_on_a_model_matches_truth_and_trajectory(setup, tmp_path):
    """Two blocks (LayerNorm at 1.0, zero biases), several steps: every logging step's figures
    equal the clone truth, and parameters and state equal the plain optimizer's bit for bit."""
    cls, kwargs = SETUPS[setup]
    model, plain_model = net(2), net(2)
    opt = Monitored(cls)(model.named_parameters(), **kwargs,
                         monitor=MonitorConfig(backend="none", compile=True, logdir=tmp_path))
    _train(model, opt, 4, check=True)
    _train(plain_model, cls(plain_model.parameters(), **kwargs), 4, check=False)
    for a, b in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)
    assert not opt.monitor._engine.capture.fused.fuser._failed


VIEWS = {"aten::select", "aten::as_strided", "aten::unsqueeze", "aten::view", "aten::reshape", "aten::slice",
         "aten::unbind", "aten::alias", "aten::detach", "aten::expand", "aten::squeeze"}
"""Ops that only make a view (new sizes and strides of the same memory): no kernel, no data read."""


def _logging_step_ops(blocks: int, cls, kwargs, tmp_path) -> tuple[int, int]:
    """aten ops other than views that the profiler records in one (warmed-up) logging step of
    ``net(blocks)``, minus those of the plain optimizer's step on the same model; and the number of
    tensors."""
    counts = []
    for monitored in (True, False):
        model = net(blocks)
        if monitored:
            opt = Monitored(cls)(model.named_parameters(), **kwargs,
                                 monitor=MonitorConfig(backend="none", compile=True, logdir=tmp_path / str(blocks)))
        else:
            opt = cls(model.parameters(), **kwargs)
        model(torch.randn(8, WIDTH)).square().mean().backward()
        for _ in range(2):  # state exists and the fused graphs are compiled
            opt.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
        names = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
        counts.append(sum(n for name, n in names.items() if name not in VIEWS))
    return counts[0] - counts[1], sum(1 for _ in model.parameters())


@pytest.mark.parametrize("setup", ["adamw-warmup", "sgd-momentum"])
def test_fused_logging_step_ops_do_not_grow_with_the_tensor_count(setup, tmp_path):
    """One block (8 tensors with the head) and four blocks (26) fit one chunk per kind: the monitor's ops
    per logging step are the same number."""
    cls, kwargs = SETUPS[setup]
    small, n_small = _logging_step_ops(1, cls, kwargs, tmp_path)
    large, n_large = _logging_step_ops(4, cls, kwargs, tmp_path)
    print(f"{setup}: monitor ops per logging step {small} ({n_small} tensors, {small / n_small:.1f} per tensor), "
          f"{large} ({n_large} tensors, {large / n_large:.1f} per tensor); 1 param group")
    assert large == small, (small, large)


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")  # torch's own note on disabling its caches
def test_a_failing_compiler_warns_once_and_runs_the_fused_capture_eagerly(tmp_path):
    """Inductor given a C++ compiler that does not exist: one warning, then the same exact figures."""
    torch._dynamo.reset()
    model = net(1)
    opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3,
                                       monitor=MonitorConfig(backend="none", compile=True, logdir=tmp_path))
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",), "force_disable_caches": True}):
        with pytest.warns(RuntimeWarning, match="compiling the fused capture failed") as caught:
            _train(model, opt, 3, check=True)
    assert sum("compiling the fused capture failed" in str(w.message) for w in caught) == 1
    assert opt.monitor._engine.capture.fused.fuser._failed
    torch._dynamo.reset()


def test_compile_off_and_auto_on_cpu_keep_the_eager_capture(tmp_path):
    """``auto`` fuses on CUDA only; ``compile=False`` never: on a CPU neither compiles anything."""
    for setting in (False, "auto"):
        model = net(1)
        opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3,
                                           monitor=MonitorConfig(backend="none", compile=setting, logdir=tmp_path))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _train(model, opt, 2, check=True)
        assert opt.monitor._engine.capture.fused.fuser._compiled == {}


class DecayIntoGrad(torch.optim.SGD):
    """An optimizer of the old style: weight decay added into ``p.grad`` in place, then the grad
    dropped (``p.grad = None``) inside its own ``step``."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(p, alpha=0.1)
                    p.add_(p.grad, alpha=-group["lr"])
                    p.grad = None


@pytest.mark.parametrize("compile", [False, True])
def test_a_step_that_rewrites_or_drops_the_grad_is_measured_on_the_grad_it_was_given(compile, tmp_path):
    """A subclass overriding ``step`` gets the clone capture, whose grad sums are taken before the
    step: a 300-element vector (the flat limit is 4,096) and an 80 x 80 matrix."""
    gen = torch.Generator().manual_seed(0)
    named = [("small", nn.Parameter(torch.randn(300, generator=gen))),
             ("large", nn.Parameter(torch.randn(80, 80, generator=gen)))]
    opt = Monitored(DecayIntoGrad)(named, lr=1e-2, monitor=MonitorConfig(backend="none", compile=compile,
                                                                         logdir=tmp_path))
    for _ in range(2):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        before, grads = truth.snapshot(named)
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))


@pytest.mark.parametrize("compile", [False, True])
def test_a_non_finite_grad_keeps_the_finite_param_norm(compile, tmp_path):
    """NaN and Inf in an AdamW matrix's grad make its update non-finite; p_before's figures stay
    those of the clone (they are taken before the step), and health names the grad and update."""
    w = nn.Parameter(torch.randn(80, 80, generator=torch.Generator().manual_seed(0)))
    opt = Monitored(torch.optim.AdamW)([("w", w)], lr=1e-3, monitor=MonitorConfig(backend="none", compile=compile,
                                                                                   logdir=tmp_path))
    w.grad = torch.randn(80, 80)
    opt.step()
    w.grad = torch.randn(80, 80)
    w.grad[0, 0], w.grad[-1, -1] = math.nan, math.inf
    want = w.detach().double().norm().item()
    with pytest.warns(RuntimeWarning, match="NaN or Inf in its grad and update at step 2"):
        opt.step()
    assert opt.monitor.latest["param_norm/w"] == pytest.approx(want, rel=1e-6)
    assert opt.monitor.latest["health/nonfinite"] == 1.0


@pytest.mark.parametrize("sizes", [[], [7], [4096] * 5, [4096, 4096, 4096, 4095, 2, 1], [1000] * 40])
def test_flat_chunks_are_greedy_consecutive_runs_within_the_budget(sizes):
    """Every parameter in exactly one chunk, in order; no chunk above FLAT_ELEMENTS elements; each chunk but
    the last is closed only because the next parameter would not fit."""
    from monitored_optim.capture import fused

    chunks = fused.flat_chunks(sizes)
    assert [i for c in chunks for i in c] == list(range(len(sizes)))
    totals = [sum(sizes[i] for i in c) for c in chunks]
    assert all(t <= fused.FLAT_ELEMENTS for t in totals)
    assert all(t + sizes[c.stop] > fused.FLAT_ELEMENTS for t, c in zip(totals[:-1], chunks[:-1]))


def test_a_parameter_that_leaves_the_flat_capture_keeps_its_ratios(tmp_path):
    """A small parameter captured flat on one logging step (a plain step), then eagerly on the next (a
    step with a closure), after the user moved it far from zero (its mean 1,000 times its spread): a
    parameter captured flat keeps no centring decision, so the eager capture's sums come centred, not
    from the uncentred decision of its first eager step, and its ratios are still sent and equal the
    clone truth."""
    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(64, 16, generator=gen))
    named = [("p", p)]
    x = torch.randn(8, 64, generator=gen)
    opt = Monitored(torch.optim.Adam)(named, lr=1e-2, monitor=MonitorConfig(backend="none", logdir=tmp_path))

    def closure():
        opt.zero_grad()
        loss = (x @ p).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)  # eager: a random matrix, uncentred sums suffice next time
    with torch.no_grad():
        p.add_(1000.0)
    closure()
    opt.step()  # flat: the mean is now 1,000 spreads
    before = {"p": p.detach().clone()}
    opt.step(closure)
    truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, {"p": p.grad.detach().clone()}))
    assert "update_to_data/p" in opt.monitor.latest and "grad_to_data/p" in opt.monitor.latest


def test_inductor_options_this_torch_does_not_know_are_left_out(monkeypatch):
    """torch.compile refuses an option its inductor does not know (torch 2.11 has no
    ``realize_cpu_opcount_threshold``, which 2.13 has): such options are left out, the others kept."""
    from monitored_optim.capture import compiler

    monkeypatch.setitem(compiler.INDUCTOR, "an_option_of_a_later_torch", 1)
    options = compiler._inductor_options()
    assert "an_option_of_a_later_torch" not in options
    assert options["realize_reads_threshold"] == 64 and options["cpp.enable_unsafe_math_opt_flag"] is False


def test_whole_parameters_go_to_a_compiled_function_at_most_chunk_at_a_time():
    """``device_chunks`` hands at most CHUNK (32) parameters to one call, per device, in order: larger
    graphs compile for longer (the element budget of the flat chunks is another constant)."""
    from types import SimpleNamespace

    from monitored_optim.capture import fused

    entries = [SimpleNamespace(p=torch.zeros(1)) for _ in range(70)]
    chunks = list(fused.device_chunks(entries))
    assert fused.CHUNK == 32 and [len(c) for c in chunks] == [32, 32, 6]
    assert [e for c in chunks for e in c] == entries


@pytest.mark.parametrize("limit", [8, 200])
def test_a_compiled_call_keeps_at_least_recompiles_graphs_and_leaves_the_users_limit(monkeypatch, tmp_path, limit):
    """Inside each compiled call of the fused capture Dynamo may keep RECOMPILES graphs per function
    (or the user's higher limit), and after it the user's own limit is back as it was."""
    from monitored_optim.capture import compiler

    seen = []
    compile_ = torch.compile

    def watched(fn, **kwargs):
        compiled = compile_(fn, **kwargs)
        return lambda *args: (seen.append(torch._dynamo.config.recompile_limit), compiled(*args))[1]

    monkeypatch.setattr(torch, "compile", watched)
    model = net(1)
    opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3,
                                       monitor=MonitorConfig(backend="none", compile=True, every=1, logdir=tmp_path))
    with torch._dynamo.config.patch(recompile_limit=limit):
        _train(model, opt, 2, check=True)
        assert torch._dynamo.config.recompile_limit == limit
    assert seen and set(seen) == {max(limit, compiler.RECOMPILES)}


def test_describe_plans_the_next_logging_step_as_the_last_one_ran(tmp_path):
    """A step with a closure takes no fused route: after it, ``describe()`` shows each parameter's route
    as taken, with no ``(next: ...)`` that a step without one would take; before any logging step it
    shows the plain step's plan (the flat and fused routes)."""
    model = net(1)
    opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3,
                                       monitor=MonitorConfig(backend="none", compile=True, every=1, logdir=tmp_path))
    planned = opt.monitor.describe().split("capture:", 1)[1]
    assert "copied flat" in planned and "fused" in planned, planned

    def closure():
        opt.zero_grad()
        loss = model(torch.randn(8, WIDTH)).square().mean()
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    routes = opt.monitor.describe().split("\nparameter ", 1)[1]  # the table's rows
    assert "next:" not in routes and "fused" not in routes and "copied flat" not in routes, routes

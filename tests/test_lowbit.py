"""Low-bit and projected optimizers (bitsandbytes' 8-bit and paged ones, torchao's 8-bit, 4-bit and FP8
AdamW, GaLore's AdamW and its 8-bit form) are measured one parameter at a time, inside their own step
(:mod:`monitored_optim.updates.turns`): the figures equal the clone truth, the trajectory is the plain
optimizer's bit for bit, and a logging step's extra peak memory, measured in a fresh process against the
plain optimizer's, is at most the largest parameter's bytes (plus the buffers every logging step has),
where the clone route held a copy of every parameter."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import truth
from lowbit import LOWBIT, build, model
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.updates.turns import BLOCK

STEPS = 3
IDS = [f"{module.split('.')[0]}-{name}" for module, name in LOWBIT]
def _cls(module: str, name: str) -> type:
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception as err:  # noqa: BLE001 - not installed, or not importable here
        pytest.skip(f"{module}.{name}: {err}")
    if name == "GaLoreAdamW8bit" and not torch.cuda.is_available():
        pytest.skip("GaLore's 8-bit AdamW calls torch.cuda.synchronize() in its step: CUDA only")
    return cls


def _run(cls: type, monitor: MonitorConfig | None, closure: bool = False):
    """STEPS steps of ``cls`` on :func:`lowbit.model` with seeded grads: the parameters and the state
    after, each step's figures beside the clone truth's, and ``describe()``."""
    net = model()
    named = list(net.named_parameters())
    opt = build(Monitored(cls) if monitor is not None else cls, named,
                **({"monitor": monitor} if monitor is not None else {}))
    gen = torch.Generator().manual_seed(2)
    pairs = []
    for _ in range(STEPS):
        grads = {n: 1e-2 * torch.randn(p.shape, generator=gen) for n, p in named}

        def regrad(grads=grads):
            for n, p in named:
                p.grad = grads[n].clone()
            return torch.zeros(())

        regrad()
        before, taken = truth.snapshot(named)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")  # torchao's and GaLore's own notices, kept from the run's output
            opt.step(regrad) if closure else opt.step()
        assert not [w for w in seen if str(w.message).startswith("monitored_optim")], [str(w.message) for w in seen]
        if monitor is not None:
            pairs.append((dict(opt.monitor.latest), truth.figures(named, before, taken)))
    state = [{k: _kept(v) for k, v in opt.state[p].items() if k != "projector"} for _, p in named]
    described = opt.monitor.describe() if monitor is not None else ""
    return [p.detach().clone() for _, p in named], state, pairs, described


def _kept(v):
    """A copy of a state value: torchao's quantized states dequantized (their codes and scales fix it)."""
    if not isinstance(v, torch.Tensor):
        return v
    return v.dequantize() if type(v) is not torch.Tensor else v.clone()


def _equal(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("closure", [False, True], ids=["plain", "closure"])
@pytest.mark.parametrize("module,name", LOWBIT, ids=IDS)
def test_low_bit_figures_equal_the_clone_truth_and_keep_the_trajectory(module, name, closure, tmp_path):
    cls = _cls(module, name)
    plain, plain_state, _, _ = _run(cls, None, closure)
    after, state, pairs, described = _run(cls, MonitorConfig(backend="none", logdir=tmp_path, every=1), closure)
    for logged, expected in pairs:
        truth.assert_figures_match(logged, expected)
    assert all(torch.equal(a, b) for a, b in zip(plain, after))
    for s, t in zip(plain_state, state):
        assert s.keys() == t.keys() and all(_equal(s[k], t[k]) for k in s)
    row = described.split("0.weight", 1)[1].splitlines()[0]  # the route it took at the last logging step
    assert "view (" in row and "clone" not in row and "replayed" not in row, described  # no copy, no replay


@pytest.mark.parametrize("module,name", LOWBIT, ids=IDS)
def test_low_bit_logging_step_holds_at_most_the_largest_parameter(module, name):
    """Measured in a fresh process (``tests/lowbit_child.py``): the monitored logging step's tracked peak
    minus the plain step's is at most the largest parameter's bytes, plus what a logging step of a view
    that rebuilds u allocates on the same model (plain SGD's: the capture's workspace and sums) and the
    turn's two float64 blocks; the clone route held every parameter's (here 20 MiB, the largest 8)."""
    _cls(module, name)
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(here / "lowbit_child.py"), module, name], check=True,
                         capture_output=True, text=True, env=env, timeout=600).stdout
    got = json.loads(out.splitlines()[-1])
    extra = got["logged"] - got["plain"]
    print(f"{module}.{name}: extra {extra / 2**20:.2f} MiB; largest parameter {got['largest'] / 2**20:.2f} MiB "
          f"of {got['params'] / 2**20:.2f} MiB")
    assert extra <= got["largest"] + got["reference"] + 2 * BLOCK * 8, got  # BLOCK float64 twice


@pytest.mark.parametrize("settings", [dict(verify=True), dict(figures="default,histograms")],
                         ids=["verify", "histograms"])
def test_verify_mode_and_a_family_that_reads_each_update_stay_exact(settings, tmp_path):
    """Verify mode checks each turn's sums against its own clone and finds no miss; the histograms, which
    bin each update element by element, get a copy of p_before instead of the turn's sums: the figures
    equal the clone truth either way, and the trajectory is the plain optimizer's."""
    cls = _cls("bitsandbytes.optim", "Lion8bit")
    plain, _, _, _ = _run(cls, None)
    after, _, pairs, _ = _run(cls, MonitorConfig(backend="none", logdir=tmp_path, every=1, **settings))
    for logged, expected in pairs:
        if settings.get("verify"):
            assert logged.pop("verify/max_rel_error") < 1e-6  # the turn's sums are the stored change's
        truth.assert_figures_match(logged, expected)
    assert all(torch.equal(a, b) for a, b in zip(plain, after))


class _PerParameter(torch.optim.Optimizer):
    """Momentum SGD that looks up each parameter's state in its own turn, as torchao's and GaLore's do."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-group["lr"])


def _shared() -> list[tuple[str, torch.nn.Parameter]]:
    """Three 64 x 32 matrices, views of one flat buffer (as a model with fused parameters keeps them)."""
    flat = torch.randn(3 * 2048, generator=torch.Generator().manual_seed(3))
    return [(f"w{i}", torch.nn.Parameter(flat[i * 2048:(i + 1) * 2048].view(64, 32))) for i in range(3)]


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_parameters_that_share_one_buffer_are_each_measured_in_their_own_turn(verify, tmp_path):
    """Three matrices in one buffer, stepped one at a time (snapshotted as aliased; verify mode also
    measures each in its turn, which takes only the parts within its own elements): the figures equal
    the clone truth, and the trajectory is the plain optimizer's."""
    from monitored_optim.updates import register
    from monitored_optim.updates.turns import Lookup, TurnView

    register(_PerParameter, TurnView(Lookup()))
    named, twin = _shared(), _shared()
    assert len({p.untyped_storage().data_ptr() for _, p in named}) == 1
    opt = Monitored(_PerParameter)(named, monitor=MonitorConfig(backend="none", logdir=tmp_path, verify=verify))
    plain = _PerParameter([p for _, p in twin])
    gen = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        for (_, p), (_, q) in zip(named, twin):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        before, grads = truth.snapshot(named)
        opt.step()
        plain.step()
        logged = dict(opt.monitor.latest)
        if verify:
            assert logged.pop("verify/max_rel_error") < 1e-6
        truth.assert_figures_match(logged, truth.figures(named, before, grads))
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(named, twin))

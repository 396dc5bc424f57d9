"""A logging step holds no copy of the model: its extra peak memory, measured by tracking every
allocation (benchmarks/memory.py), is a small fraction of the parameter bytes for state-aware
views, against 100% for clone-and-diff."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from memory import PeakMemory  # noqa: E402

from monitored_optim import Monitored, MonitorConfig  # noqa: E402

LAYERS, WIDTH = 24, 1024


def deep_model(layers=LAYERS):
    """24 linear layers, orthogonal so that the signal (and every layer's gradient) keeps its size:
    with torch's default init it shrinks 0.58x per layer and the deep layers' updates round away."""
    torch.manual_seed(0)
    linears = [nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)]
    for layer in linears:
        nn.init.orthogonal_(layer.weight)
    return nn.Sequential(*linears)


def peak_of_step(cls, kwargs, monitor, steps_before=2, layers=LAYERS):
    model = deep_model(layers)
    opt = cls(model.named_parameters(), **kwargs, **({"monitor": monitor} if monitor else {}))
    if callable(getattr(opt, "train", None)):
        opt.train()  # a schedule-free optimizer's step needs train mode
    x = torch.randn(4, WIDTH)
    for _ in range(steps_before):  # optimizer state exists before the measured step
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    opt.zero_grad()
    model(x).square().mean().backward()
    with PeakMemory() as mem:
        opt.step()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return mem.peak, param_bytes


@pytest.mark.parametrize("cls,kwargs,bound", [
    (torch.optim.AdamW, dict(lr=1e-3), 0.10),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9), 0.10),
    (torch.optim.Adafactor, dict(lr=1e-2), 0.10),  # factored: rebuilt a block of rows at a time
    (torch.optim.Adadelta, dict(lr=1.0, weight_decay=0.1), 1.20),  # weight decay: clone fallback
], ids=["AdamW", "SGD-momentum", "Adafactor", "Adadelta-wd-clone"])
def test_extra_peak_memory_of_a_logging_step(cls, kwargs, bound):
    plain, param_bytes = peak_of_step(cls, kwargs, None)
    logged, _ = peak_of_step(Monitored(cls), kwargs, MonitorConfig(backend="none"))
    extra = (logged - plain) / param_bytes
    print(f"{cls.__name__}: extra peak {extra:.1%} of {param_bytes / 2**20:.0f} MiB of parameters")
    assert extra <= bound
    if bound > 1:
        assert extra >= 0.99  # the clone fallback really holds a copy: the measurement can see one


def test_workspace_reuses_its_buffers_and_never_hands_out_live_memory():
    """``workspace.Workspace``: ``one`` gives the same memory each time, ``next`` gives disjoint slices
    of its own buffer until ``reset``, a request larger than what is left gets a tensor of its own,
    and the results of an op written there equal the op's own."""
    from monitored_optim.workspace import Workspace

    work = Workspace(nbytes=64 * 4)
    x = torch.randn(8, 4)
    a, b = work.one(x), work.one(x)
    assert a.shape == x.shape and a.dtype == x.dtype and a.data_ptr() == b.data_ptr()
    first, second = work.next(x), work.next(x)  # 32 + 32 elements: the whole buffer
    assert first.data_ptr() != second.data_ptr()
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert {first.untyped_storage().data_ptr()}.isdisjoint({a.untyped_storage().data_ptr()})
    third = work.next(x)  # nothing left: its own tensor
    assert third.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    work.reset()
    assert work.next(x).data_ptr() == first.data_ptr()
    assert work.one(torch.randn(100)).numel() == 100  # larger than the buffer: its own tensor
    y = torch.randn(8, 4)
    assert torch.equal(torch.sub(x, y, out=work.one(x)), x - y)
    assert work.one(x.double()).dtype == torch.float64  # one buffer per dtype


@pytest.mark.parametrize("module,name,kwargs", [
    ("schedulefree", "AdamWScheduleFree", dict(lr=1e-3, weight_decay=0.1)),
    ("bitsandbytes.optim", "AdamW", dict(lr=1e-3, weight_decay=0.1, optim_bits=32)),
    ("lion_pytorch", "Lion", dict(lr=1e-4)),
    ("prodigyopt", "Prodigy", dict(lr=1.0)),
    ("transformers.optimization", "Adafactor", dict(lr=1e-3, scale_parameter=False, relative_step=False)),
], ids=["schedulefree-adamw", "bnb-adamw32", "lion", "prodigy", "hf-adafactor"])
def test_first_logging_step_of_a_third_party_view_holds_no_copy(module, name, kwargs):
    """The very first step, the optimizer's state still empty, is a logging step like the others:
    its extra peak stays a small fraction of the parameter bytes (invariant 3)."""
    cls = getattr(pytest.importorskip(module), name)
    plain, param_bytes = peak_of_step(cls, kwargs, None, steps_before=0, layers=6)
    logged, _ = peak_of_step(Monitored(cls), kwargs, MonitorConfig(backend="none"), steps_before=0, layers=6)
    assert (logged - plain) / param_bytes <= 0.10


@pytest.mark.parametrize("name,kwargs,steps_before", [
    ("SGDScheduleFree", dict(lr=1.0), 4),
    ("SGDScheduleFree", dict(lr=1e-3, weight_decay=1e-2, warmup_steps=8), 4),
    ("RAdamScheduleFree", dict(lr=1e-3), 4),
    ("RAdamScheduleFree", dict(lr=1e-4, weight_decay=1e-2), 6),
], ids=["sgd-1", "sgd-1e-3-wd-warmup", "radam-1e-3-first-rectified", "radam-1e-4-wd"])
def test_schedule_free_sgd_and_radam_logging_steps_hold_no_copy(name, kwargs, steps_before):
    """Past the steps the rebuild serves (w = 1, 1/2; RAdam's first rectified step, which lands on a z
    that never moved, included), where the lerp towards z leaves p_before unrecoverable, a logging
    step keeps the sums of the step replayed, not a clone: its extra peak stays a small fraction of the
    parameter bytes."""
    cls = getattr(pytest.importorskip("schedulefree"), name)
    plain, param_bytes = peak_of_step(cls, kwargs, None, steps_before=steps_before, layers=8)
    logged, _ = peak_of_step(Monitored(cls), kwargs, MonitorConfig(backend="none"), steps_before=steps_before,
                             layers=8)
    assert (logged - plain) / param_bytes <= 0.10  # the replay's block buffers, about 2 MiB


@pytest.mark.parametrize("weight_decay,warmup_steps", [(0.0, 0), (1e-4, 8)], ids=["plain", "wd-warmup"])
def test_schedule_free_rebuild_holds_a_blocks_temporaries_not_a_parts(weight_decay, warmup_steps):
    """The rebuild of a part of ``PART_ELEMENTS`` (after the step that creates z and the one at w = 1/2)
    allocates its result and float64 temporaries of one block (``CHECK_BLOCK``): no float64 copy of
    the part (8 bytes an element, against the part's own 4)."""
    from monitored_optim.workspace import PART_ELEMENTS
    from monitored_optim.updates._shared import CHECK_BLOCK
    from monitored_optim.updates.schedulefree import SGDScheduleFreeView

    cls = pytest.importorskip("schedulefree").SGDScheduleFree
    p = nn.Parameter(torch.randn(PART_ELEMENTS) * 0.02)
    opt = cls([p], lr=1.0, weight_decay=weight_decay, warmup_steps=warmup_steps)
    opt.train()
    for _ in range(2):
        p.grad = torch.randn_like(p) * 1e-3
        opt.step()
    with PeakMemory() as mem:
        u = SGDScheduleFreeView().update(opt.param_groups[0], p, opt.state[p], None)
    assert u.shape == p.shape and u.dtype == p.dtype
    assert mem.peak <= p.numel() * 4 + 2 * CHECK_BLOCK * 8

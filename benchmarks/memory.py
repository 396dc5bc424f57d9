"""Peak bytes of the tensors that a block of code allocates, on any device, without a profiler.

A ``TorchDispatchMode`` sees every aten op: each output that does not alias an input's storage
(views, in-place and ``out=`` results alias) is a new allocation of ``storage.nbytes()`` bytes,
freed when the last tensor holding it (outputs of later view ops included) is garbage collected.
``peak`` is the largest total alive at any moment. Tensors that existed before the block (weights,
grads, optimizer state) are not counted; new state that the block creates and keeps is.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory() as m: ...`` then ``m.peak`` (bytes, int) and ``m.live`` (bytes still held)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = t.untyped_storage().data_ptr()
            if key in self._refs:
                self._hold(t, key)
            elif key not in inputs and t.untyped_storage().nbytes() > 0:
                self._sizes[key] = t.untyped_storage().nbytes()
                self.live += self._sizes[key]
                self.peak = max(self.peak, self.live)
                self._hold(t, key)
        return out

    def _hold(self, t: torch.Tensor, key: int) -> None:
        self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)


@contextlib.contextmanager
def _quiet_stderr():
    """Send file descriptor 2 to /dev/null for the block: the profiler's C++ side prints a line per
    start and stop there ("USDT: ... profiler_start"), which Python's warnings filters cannot reach."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def allocated_peak(fn) -> int:
    """Peak bytes allocated above what was live when ``fn()`` started, from the profiler's memory
    events (every allocation of the CPU allocator, compiled kernels' buffers included, which a
    dispatch mode such as :class:`PeakMemory` does not see); on CUDA, ``max_memory_allocated``."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with _quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                 profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


GPT2 = dict(vocab=50257, width=768, blocks=12)


def gpt2_shaped(dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of GPT-2 small, named as in Hugging Face's ``GPT2LMHeadModel`` (token and
    position embeddings, 12 blocks of LayerNorms, fused qkv, projections and MLP, final LayerNorm;
    the head is tied to the token embedding, so it is not a parameter of its own): 148 tensors,
    124M elements, LayerNorm gains at 1.0 and biases at 0, weights N(0, 0.02)."""
    torch.manual_seed(0)
    d, out = GPT2["width"], []

    def add(name, *shape, fill=None):
        t = (torch.full(shape, fill, dtype=dtype) if fill is not None
             else torch.empty(shape, dtype=dtype).normal_(0, 0.02))
        out.append((name, torch.nn.Parameter(t)))

    add("transformer.wte.weight", GPT2["vocab"], d)
    add("transformer.wpe.weight", 1024, d)
    for i in range(GPT2["blocks"]):
        h = f"transformer.h.{i}."
        add(h + "ln_1.weight", d, fill=1.0), add(h + "ln_1.bias", d, fill=0.0)
        add(h + "attn.c_attn.weight", d, 3 * d), add(h + "attn.c_attn.bias", 3 * d, fill=0.0)
        add(h + "attn.c_proj.weight", d, d), add(h + "attn.c_proj.bias", d, fill=0.0)
        add(h + "ln_2.weight", d, fill=1.0), add(h + "ln_2.bias", d, fill=0.0)
        add(h + "mlp.c_fc.weight", d, 4 * d), add(h + "mlp.c_fc.bias", 4 * d, fill=0.0)
        add(h + "mlp.c_proj.weight", 4 * d, d), add(h + "mlp.c_proj.bias", d, fill=0.0)
    add("transformer.ln_f.weight", d, fill=1.0), add("transformer.ln_f.bias", d, fill=0.0)
    return out


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=6e-4, weight_decay=0.1)),
    "sgd-momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
    "adafactor": (torch.optim.Adafactor, dict(lr=1e-2)),
}
"""Optimizer name -> (class, keyword arguments); the third-party ones with a view are added below
where their package is installed."""


def _third_party() -> dict[str, tuple[type, dict]]:
    """The third-party optimizers with a view whose package is installed, and one without (the
    clone fallback's cost)."""
    import importlib

    found = {}
    for name, module, cls, kwargs in (
            ("lion", "lion_pytorch", "Lion", dict(lr=1e-4)),
            ("lion-optimizer", "pytorch_optimizer", "Lion", dict(lr=1e-4, weight_decay=0.1)),
            ("prodigy", "prodigyopt", "Prodigy", dict(lr=1.0, weight_decay=0.1)),
            ("schedulefree-adamw", "schedulefree", "AdamWScheduleFree", dict(lr=1e-3, weight_decay=0.1)),
            *((f"schedulefree-sgd-{lr:g}", "schedulefree", "SGDScheduleFree", dict(lr=lr, weight_decay=wd))
              for lr, wd in ((1.0, 0.0), (1e-2, 1e-4), (1e-3, 0.0))),
            *((f"schedulefree-sgd-{lr:g}-warmup", "schedulefree", "SGDScheduleFree",  # every step in its warm-up
               dict(lr=lr, weight_decay=1e-4, warmup_steps=8)) for lr in (1.0, 1e-3)),
            *((f"schedulefree-radam-{lr:g}", "schedulefree", "RAdamScheduleFree", dict(lr=lr, weight_decay=wd))
              for lr, wd in ((1e-3, 0.0), (1e-4, 0.1))),
            ("hf-adafactor", "transformers.optimization", "Adafactor",
             dict(lr=1e-3, scale_parameter=False, relative_step=False)),
            ("bnb-adamw32", "bitsandbytes.optim", "AdamW", dict(lr=6e-4, weight_decay=0.1, optim_bits=32)),
            # low-bit and projected: measured in each parameter's turn of the step (updates/turns.py)
            *((f"bnb-{cls.lower()}", "bitsandbytes.optim", cls, dict(lr=6e-4, weight_decay=0.1))
              for cls in ("AdamW8bit", "PagedAdamW8bit", "Lion8bit")),
            *((f"torchao-{cls.lower()}", "torchao.optim", cls, dict(lr=6e-4, weight_decay=0.1))
              for cls in ("AdamW8bit", "AdamW4bit", "AdamWFp8")),
            ("galore-adamw", "galore_torch", "GaLoreAdamW", dict(lr=6e-4, weight_decay=0.1, galore=GALORE)),
            ("adabelief", "pytorch_optimizer", "AdaBelief", dict(lr=1e-3))):  # no view: the clone fallback
        try:
            found[name] = (getattr(importlib.import_module(module), cls), kwargs)
        except Exception:  # noqa: BLE001 - not installed, or not importable here
            continue
    return found


GALORE = dict(rank=128, update_proj_gap=200, scale=0.25, proj_type="std")
"""GaLore's projection of the matrices (its README's settings for a model of this size)."""


def _built(cls: type, params: list, kwargs: dict, **extra) -> torch.optim.Optimizer:
    """``cls(params, **kwargs, **extra)``, in train mode for a schedule-free optimizer; a ``galore``
    keyword puts the matrices in a param group of its own with those settings (GaLore's projection)."""
    kwargs = dict(kwargs)
    galore = kwargs.pop("galore", None)
    if galore is not None:
        params = [{"params": [p for p in params if (p[1] if isinstance(p, tuple) else p).dim() == 2], **galore},
                  {"params": [p for p in params if (p[1] if isinstance(p, tuple) else p).dim() != 2]}]
    opt = cls(params, **kwargs, **extra)
    if callable(getattr(opt, "train", None)):
        opt.train()
    return opt


PROFILED = ("torchao-",)
"""Optimizers whose steps are tracked by :func:`allocated_peak` (the profiler's allocations) rather than
:class:`PeakMemory`: torchao's step is compiled (its kernels' buffers are the CPU allocator's, not ops a
dispatch mode sees, and its quantized state's storage cannot be read by one)."""

STEPS = {"schedulefree-radam-0.001": 7, "schedulefree-radam-0.0001": 7}
"""Steps per run other than 3: RAdam schedule-free's first 4 leave every weight as it is (its silent
phase), so its runs go on to its rectified steps."""


def _steps(name: str, monitored: bool, steps: int | None = None, track: bool = False) -> tuple[int, int]:
    """Build the GPT-2-shaped parameters and run ``steps`` steps of optimizer ``name`` (every step
    a logging step when ``monitored``), with random grads. Returns (peak bytes that the steps
    allocated, tracked by :class:`PeakMemory` when ``track``, else 0; parameter bytes)."""
    from monitored_optim import Monitored, MonitorConfig

    named = gpt2_shaped()
    cls, kwargs = {**OPTIMIZERS, **_third_party()}[name]
    if monitored:
        opt = _built(Monitored(cls), named, kwargs, monitor=MonitorConfig(backend="none", every=1))
    else:
        opt = _built(cls, [p for _, p in named], kwargs)
    gen = torch.Generator().manual_seed(1)
    peak = 0
    for _ in range(steps or STEPS.get(name, 3)):
        for _, p in named:  # in place after the first step: no transient second copy of the grads
            p.grad = torch.empty_like(p) if p.grad is None else p.grad
            p.grad.normal_(0, 1e-3, generator=gen)
        if track and name.startswith(PROFILED):
            peak = max(peak, allocated_peak(opt.step))
        elif track:
            with PeakMemory() as mem:
                opt.step()
            peak = max(peak, mem.peak)
        else:
            opt.step()
    return peak, sum(p.numel() * p.element_size() for _, p in named)


def _warm(name: str) -> None:
    """Two logging steps of optimizer ``name`` on a 256 x 512 layer (its weight cut into parts, as the
    model's large ones are), freed before the model is built:
    the one-time costs of a process's first logging step (torch kernels run for the first time,
    their code pages and lazily built tables, the library's modules) are then in both processes,
    and what differs is what scales with the model."""
    from monitored_optim import Monitored, MonitorConfig

    # a weight above fused.SMALL, cut in two parts: the per-part path's kernels run too
    layer = torch.nn.Linear(256, 512)
    cls, kwargs = {**OPTIMIZERS, **_third_party()}[name]
    opt = _built(Monitored(cls), list(layer.named_parameters()), kwargs, monitor=MonitorConfig(backend="none", every=1))
    for _ in range(2):
        layer(torch.randn(4, 256)).sum().backward()
        opt.step()
    opt.monitor.close()


def _child(name: str, monitored: bool) -> None:
    _warm(name)
    _steps(name, monitored)
    with open("/proc/self/status") as status:  # VmHWM: this process's peak RSS (ru_maxrss is
        fields = dict(line.split(":", 1) for line in status)  # inherited across fork)
    print(*(int(fields[key].split()[0]) * 1024 for key in ("VmHWM", "RssFile")))


def _fresh_rss(name: str, monitored: bool, fixed_mmap: bool = False) -> tuple[int, int]:
    """Peak RSS (bytes, Linux ``VmHWM``) of a fresh Python process that runs :func:`_warm` then
    :func:`_steps`, and its file-backed resident bytes at the end (``RssFile``: pages of shared
    libraries' code and data, such as the torch kernels a logging step runs for the first time, not
    allocated memory). ``fixed_mmap``: with glibc's mmap threshold fixed at 128 KiB
    (``MALLOC_MMAP_THRESHOLD_``), so that every large block is mapped on its own and unmapped when
    freed, rather than served from a heap whose layout differs from run to run."""
    import subprocess

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(FIXED_MMAP)} if fixed_mmap else None
    out = subprocess.run([sys.executable, __file__, "--child", name, str(int(monitored))],
                         check=True, capture_output=True, text=True, env=env).stdout
    hwm, file_backed = out.split()[-2:]
    return int(hwm), int(file_backed)


FIXED_MMAP = 128 * 1024
"""glibc's default mmap threshold, fixed (it otherwise rises to the size of the largest block freed)."""

PAIRS = 3
"""Fresh plain and monitored processes per optimizer under glibc's defaults (the median is shown)."""


def main() -> None:
    """``python benchmarks/memory.py [OPTIMIZER ...]``: the extra memory of logging steps (the first
    included) on a GPT-2-shaped model, as tracked allocations and as peak RSS in fresh processes,
    in % of parameter bytes.

    Peak RSS under glibc's defaults varies between identical runs (the plain AdamW process alone by
    up to 36 MiB, 8% of the parameter bytes: the step's own temporaries, 62% of them, land in the
    heap or in maps as its dynamic threshold has moved), so it is shown as the median of
    :data:`PAIRS` pairs with the plain peaks' spread, and once more with the threshold fixed, where
    it repeats to 0.1 MiB."""
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], sys.argv[3] == "1")
        return
    names = sys.argv[1:] or [*OPTIMIZERS, *_third_party()]
    print(f"extra memory of logging steps, % of parameter bytes (every step a logging step); peak RSS: "
          f"median of {PAIRS} fresh pairs, and with a fixed mmap threshold")
    print("optimizer      tracked   peak RSS (spread of plain)   fixed threshold   file-backed")
    for name in names:
        plain, param_bytes = _steps(name, False, track=True)
        logged, _ = _steps(name, True, track=True)
        pairs = [(_fresh_rss(name, False), _fresh_rss(name, True)) for _ in range(PAIRS)]
        extra = statistics.median(b[0] - a[0] for a, b in pairs)
        spread = max(a[0] for a, _ in pairs) - min(a[0] for a, _ in pairs)
        files = statistics.median(b[1] - a[1] for a, b in pairs)
        fixed = _fresh_rss(name, True, fixed_mmap=True)[0] - _fresh_rss(name, False, fixed_mmap=True)[0]
        print(f"{name:<14} {(logged - plain) / param_bytes:>7.2%}   {extra / param_bytes:>8.2%} "
              f"({spread / 2**20:>5.1f} MiB)"
              f"{'':<4} {fixed / param_bytes:>15.2%}   {files / param_bytes:>11.2%}"
              f"   ({param_bytes / 2**20:.0f} MiB of parameters)")


if __name__ == "__main__":
    main()

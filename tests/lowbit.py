"""The low-bit and projected optimizers of tests/test_lowbit.py, and the model they step."""

from __future__ import annotations

import torch

LOWBIT = [*(("bitsandbytes.optim", name) for name in (
    "AdamW8bit", "Adam8bit", "PagedAdamW8bit", "Lion8bit", "PagedLion8bit", "SGD8bit", "AdEMAMix8bit")),
    *(("torchao.optim", name) for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8")),
    ("galore_torch", "GaLoreAdamW"), ("galore_torch", "GaLoreAdamW8bit")]
"""(module, class): bitsandbytes 0.50's 8-bit and paged optimizers, torchao 0.18's 8-bit, 4-bit and FP8
AdamW, GaLore 1.0's AdamW and its 8-bit form (whose step calls ``torch.cuda.synchronize``: CUDA only)."""


def model() -> torch.nn.Sequential:
    """Three 1024 x 1024 matrices and a 2048 x 1024 one (the largest, 8 MiB of 20 MiB), a bias at 0 and
    a LayerNorm at 1.0 and 0."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 1024, bias=False),
                              torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 2048),
                              torch.nn.LayerNorm(2048))
    torch.nn.init.zeros_(net[3].bias)
    return net


def build(cls: type, named: list, **extra) -> torch.optim.Optimizer:
    """``cls`` over ``named``, lr 1e-3 (SGD8bit with momentum 0.9); GaLore's with its matrices in a param
    group of rank 16 (projected) and the other parameters in a plain one."""
    kwargs = dict(lr=1e-3, **extra)
    if cls.__name__ == "SGD8bit" or any(c.__name__ == "SGD8bit" for c in cls.__mro__):
        kwargs["momentum"] = 0.9
    if "galore" in cls.__module__ or any("galore" in c.__module__ for c in cls.__mro__):
        matrices = [(n, p) for n, p in named if p.dim() == 2]
        others = [(n, p) for n, p in named if p.dim() != 2]
        groups = [{"params": matrices, "rank": 16, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"},
                  {"params": others}]
        return cls(groups, **kwargs)
    return cls(named, **kwargs)

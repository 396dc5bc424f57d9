"""Small deterministic problems shared by the tests: named param groups, a parameter with no grad."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class Problem:
    """A model, its named param groups for the optimizer, and a loss function of a batch index."""

    model: nn.Module
    specs: list[dict[str, Any]]
    loss: Callable[[int], torch.Tensor]

    def __post_init__(self):
        self.named = [(n, p) for g in self.specs for n, p in g["params"]]

    def closure(self, opt: torch.optim.Optimizer, i: int) -> Callable[[], torch.Tensor]:
        """The usual closure for batch ``i``: zero the grads, compute the loss, backward, return it."""
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = self.loss(i)
            loss.backward()
            return loss
        return closure

    @property
    def groups(self) -> list[dict[str, Any]]:
        """Fresh copies of the named param groups (torch rewrites the dicts it is given)."""
        return [{**g, "params": list(g["params"])} for g in self.specs]


def train(problem: Problem, steps: int, **config: Any) -> torch.optim.Optimizer:
    """A monitored AdamW (lr 1e-2, ``MonitorConfig(**config)``) on ``problem``'s named groups, after
    ``steps`` steps of its losses."""
    from monitored_optim import Monitored, MonitorConfig

    opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=MonitorConfig(**config))
    for i in range(steps):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()
    return opt


def mlp(dtype=torch.float32, bias=True, two_groups=True, group_overrides=None) -> Problem:
    """fc1 -> tanh -> fc2 on random regression data; ``unused`` gets no grad. Two param groups
    (fc1 | fc2 + unused) with different hyperparameters, unless ``two_groups`` is False."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"fc1": nn.Linear(6, 8, bias=bias), "fc2": nn.Linear(8, 4, bias=bias),
                           "unused": nn.Linear(3, 3, bias=bias)}).to(dtype)
    xs = torch.randn(8, 16, 6, dtype=dtype)
    ys = torch.randn(8, 16, 4, dtype=dtype)
    named = list(model.named_parameters())
    if two_groups:
        groups = [{"params": [(n, p) for n, p in named if n.startswith("fc1")]},
                  {"params": [(n, p) for n, p in named if not n.startswith("fc1")], **(group_overrides or {})}]
    else:
        groups = [{"params": named}]

    def loss(i: int) -> torch.Tensor:
        h = torch.tanh(model["fc1"](xs[i % 8]))
        return (model["fc2"](h) - ys[i % 8]).pow(2).mean()

    return Problem(model, groups, loss)


def embeddings(dtype=torch.float32) -> Problem:
    """Two sparse embeddings (sparse grads, for SparseAdam) and an unused one."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(20, 5, sparse=True), "emb2": nn.Embedding(10, 5, sparse=True),
                           "unused": nn.Embedding(4, 5, sparse=True)}).to(dtype)
    idx = torch.randint(0, 10, (8, 12))
    named = list(model.named_parameters())
    groups = [{"params": named[:1]}, {"params": named[1:], "lr": 5e-3}]

    def loss(i: int) -> torch.Tensor:
        return (model["emb"](idx[i % 8]) * model["emb2"](idx[i % 8]).tanh()).sum()

    return Problem(model, groups, loss)

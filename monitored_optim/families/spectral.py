"""Spectral size of matrix updates: the RMS-to-RMS operator norm and the stable rank.

For a matrix parameter (ndim >= 2) viewed as U of shape (fan_out, fan_in), fan_out = shape[0] and
fan_in = numel / shape[0], and its stored change u:

    update_spectral/{name}    = sigma_max(u) · sqrt(fan_in / fan_out)      (the RMS -> RMS norm)
    update_stable_rank/{name} = ||u||_F^2 / sigma_max(u)^2

sigma_max comes from subspace (block power) iteration on uᵀu with a persistent orthonormal block X
of :data:`BLOCK` vectors per parameter, warm started from the last logging step (as
``torch.nn.utils.parametrizations.spectral_norm`` keeps its vectors): Y = u X, X ← orth(uᵀ Y), and
sigma = the largest singular value of Y (Rayleigh-Ritz: a lower bound that the iteration raises to
sigma_max). :data:`ITERATIONS` iterations per logging step for a matrix reduced whole (at most
262,144 elements), one for a larger one reduced a block of rows at a time (its uᵀY and YᵀY
accumulate over the blocks). Cost per logging step: 2·BLOCK multiply-adds per element of u per
iteration (128 per element for a small matrix, 32 for a large one), in matrix products.
Source: muP's spectral condition (Yang, Simon & Bernstein 2023, "A spectral condition for feature
learning"); Golub & Van Loan, "Matrix Computations", §8.2 (power iteration).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..pieces import WHOLE
from .base import Family, Step

ITERATIONS = 4
BLOCK = 16
"""Vectors iterated together (subspace iteration): with the Rayleigh-Ritz estimate from a block,
sigma_max converges within a few logging steps even where the top singular values are close
(Muon's orthogonalized updates have a nearly flat spectrum, where one vector converges slowly)."""


class Spectral(Family):
    """The ``spectral`` family (see the module docstring)."""

    name = "spectral"
    series = ("update_spectral", "update_stable_rank")
    pieces = {"spectral": WHOLE}

    def __init__(self) -> None:
        self._x: dict[str, Tensor] = {}
        self._open: dict[str, list[Tensor] | None] = {}  # name -> [Z, YᵀY] over the blocks of rows so far

    def part(self, name: str, whole: Tensor, u: Tensor, span: slice | None, state: dict[str, Any],
             group: dict[str, Any]) -> dict[str, Tensor]:
        if whole.dim() < 2 or whole.is_complex() or whole.shape[0] < 2:
            return {}
        cols = whole.numel() // whole.shape[0]
        if span is None:
            m, bad = _finite(u.reshape(whole.shape[0], cols))
            x = self._vectors(name, cols, m)
            for _ in range(ITERATIONS):
                y = m @ x
                x = _orthonormal(m.T @ y)
            self._x[name] = x
            return {"spectral": _largest(y.T @ y, bad).reshape(1)}
        if span.start % cols or span.stop % cols:
            self._open[name] = None  # not whole rows: no product of this part alone
            return {}
        m, bad = _finite(u.reshape(-1, cols))
        x = self._vectors(name, cols, m)
        y = m @ x
        if name not in self._open:
            self._open[name] = [torch.zeros_like(x), x.new_zeros(x.shape[1], x.shape[1]), bad]
        sums = self._open[name]
        if sums is not None:
            sums[0] += m.T @ y
            sums[1] += y.T @ y
            sums[2] = sums[2] | bad
        return {}

    def done(self) -> dict[str, dict[str, Tensor]]:
        """Finish the iteration of the parameters reduced a block of rows at a time."""
        out = {}
        for name, sums in self._open.items():
            if sums is not None:
                self._x[name] = _orthonormal(sums[0])
                out[name] = {"spectral": _largest(sums[1], sums[2]).reshape(1)}
        self._open = {}
        return out

    def _vectors(self, name: str, cols: int, like: Tensor) -> Tensor:
        x = self._x.get(name)
        if x is None or x.shape[0] != cols or x.device != like.device:
            gen = torch.Generator(device="cpu").manual_seed(cols)
            x = _orthonormal(torch.randn(cols, min(BLOCK, cols), generator=gen, dtype=torch.float64).to(like.device))
            self._x[name] = x
        return x

    def figures(self, step: Step) -> dict[str, float]:
        out = {}
        fro = step.table.sq_norm[:, 2].tolist()
        for name, pieces, shape, fro_sq in zip(step.names, step.pieces, step.shapes, fro):
            sigma = pieces.get("spectral", [0.0])[0]
            if sigma > 0:
                out[f"update_spectral/{name}"] = sigma * (shape.numel() // shape[0] / shape[0]) ** 0.5
                out[f"update_stable_rank/{name}"] = fro_sq / (sigma * sigma)
        return out


def _orthonormal(z: Tensor) -> Tensor:
    return torch.linalg.qr(z).Q


def _finite(u: Tensor) -> tuple[Tensor, Tensor]:
    """``u`` in float64 with its non-finite elements zeroed, and whether it had any (a 0-dim bool on
    its device: no host read), so that an update that blew up gives no figure instead of a failed
    eigensolver."""
    m = u.double()
    finite = m.isfinite()
    return torch.where(finite, m, 0.0), ~finite.all()


def _largest(gram: Tensor, bad: Tensor) -> Tensor:
    """sigma_max of U X from (U X)ᵀ(U X): the square root of its largest eigenvalue; NaN where
    ``bad`` (the update held non-finite values), which the figures then leave out."""
    finite = gram.isfinite()  # a finite update can still overflow in the products
    sigma = torch.linalg.eigvalsh(torch.where(finite, gram, 0.0))[-1].clamp(min=0).sqrt()
    return torch.where(bad | ~finite.all(), math.nan, sigma)

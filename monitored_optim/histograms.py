"""The fixed bins of the ``histograms`` family: signed powers of two, the same for every tensor.

Every histogram the monitor makes (``update_hist/{name}``, ``grad_hist/{name}``,
``param_hist/{name}``) counts the finite elements of a tensor in the same :data:`NBINS` bins, with
the :data:`EDGES` e_0 < e_1 < ... < e_{m-1} (m = ``NBINS - 1``):

    bin 0       x < e_0 = -2**HIGH            (open-ended)
    bin i       e_{i-1} <= x < e_i            (numpy's half-open bins)
    bin m       x >= e_{m-1} = 2**HIGH        (open-ended)

The edges are ``-2**HIGH, ..., -2**LOW, 2**LOW, ..., 2**HIGH``, one bin per power of two (about
3.3 per decade) on each side, so the bin between ``-2**LOW`` and ``2**LOW`` (:data:`ZERO`, about
±9.1e-13) holds the exact zeros: an update lost to bf16 rounding, a frozen weight, a zero gradient.
Every edge is a power of two, exact in float32, float64, bfloat16's and float16's float32 upcast,
so a count does not depend on the dtype the comparison runs in, and counts equal
``numpy.histogram(x, [-inf, *EDGES, inf])`` over the finite elements of x. Non-finite elements are
not binned (``health/`` counts them). Counts of the same bins add: over the parts and shards of a
parameter, over ranks, over steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOW, HIGH = -40, 16
"""The smallest and largest magnitude edges: 2**-40 (about 9.1e-13) and 2**16 (65,536)."""

EDGES: tuple[float, ...] = tuple([-(2.0 ** k) for k in range(HIGH, LOW - 1, -1)]
                                 + [2.0 ** k for k in range(LOW, HIGH + 1)])
"""The bin edges, increasing: 114 signed powers of two."""

NBINS = len(EDGES) + 1
"""Bins per histogram: 115 (the two outer ones open-ended)."""

ZERO = EDGES.index(-(2.0 ** LOW)) + 1
"""The bin of zero: ``-2**LOW <= x < 2**LOW``."""

KEYS = {"u": "update_hist", "grad": "grad_hist", "param": "param_hist"}
"""What is binned -> its piece key and tag series: the stored change u, the grad the step used,
the parameter after the step."""

_EDGES: dict[torch.device, Tensor] = {}


def counts(x: Tensor, scale: Tensor | None = None) -> Tensor:
    """The histogram of ``x``'s finite elements over :data:`EDGES`, on ``x``'s device.

    Args:
        x: a floating tensor of any shape, dtype and layout (bfloat16/float16 are compared after an
            exact upcast to float32; a complex one as its real and imaginary parts; a sparse one
            with its zeros).
        scale: an optional 0-dim tensor by which ``x`` is multiplied first (the reciprocal of a
            fused GradScaler's power-of-two scale: exact).

    Returns:
        Float64 tensor of shape ``(NBINS,)``: the counts (whole numbers; float64 so that they add
        with the other pieces, exactly up to 2**53 elements). No host sync.
    """
    x = x.detach()
    if x.is_sparse:  # nn.Embedding(sparse=True)'s grad: its zeros count too
        x = x.to_dense()
    flat = (torch.view_as_real(x) if x.is_complex() else x).reshape(-1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    if scale is not None:
        flat = flat * scale.to(flat.dtype)
    edges = _EDGES.get(flat.device)
    if edges is None:
        edges = _EDGES[flat.device] = torch.tensor(EDGES, dtype=torch.float32, device=flat.device)
    index = torch.bucketize(flat, edges.to(flat.dtype), right=True)
    index = torch.where(flat.isfinite(), index, NBINS)  # non-finite: one bin past the last, dropped
    return torch.bincount(index, minlength=NBINS + 1)[:NBINS].double()


def zeros(n: int, device: torch.device) -> Tensor:
    """The histogram of ``n`` exact zeros (a part the view says did not move): float64 ``(NBINS,)``."""
    out = torch.zeros(NBINS, dtype=torch.float64, device=device)
    out[ZERO] = n
    return out


def of(names: list[str], pieces: list[dict[str, list[float]]]) -> dict[str, list[int]]:
    """The logging step's histograms, tag (``update_hist/{name}``, ...) -> counts (:data:`NBINS`
    ints), from each parameter's host pieces (``names[i]``'s in ``pieces[i]``; empty where the
    ``histograms`` family is off). Counts reduced over ranks are weighted sums: rounded here."""
    return {f"{key}/{name}": [round(c) for c in got[key]]
            for name, got in zip(names, pieces) for key in KEYS.values() if key in got}

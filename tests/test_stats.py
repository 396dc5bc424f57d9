"""stats.Batch and hosted.MomentTable against float64 references computed here with plain torch."""

from __future__ import annotations

import math

import pytest
import torch

from monitored_optim import hosted, stats


def reference(x: torch.Tensor, factor: float = 1.0) -> tuple[float, float]:
    """(mean, m2) of factor * x in float64: complex as pairs of reals, sparse densified."""
    if x.is_sparse:
        x = x.to_dense()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.detach().double().reshape(-1) * factor
    if x.numel() == 0:
        return 0.0, 0.0
    mean = x.mean()
    return mean.item(), ((x - mean) ** 2).sum().item()


def tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(300, 7),
        torch.randn(50, dtype=torch.float64) * 3 + 2,
        (torch.randn(64, 64) * 0.1).bfloat16(),
        torch.randn(40, dtype=torch.complex64),
        torch.sparse_coo_tensor(torch.tensor([[1, 5, 5]]), torch.tensor([1.0, 2.0, -0.5]), (9,)),
        torch.zeros(0, 3),
        torch.tensor(1.5),
        1.0 + 1e-4 * torch.randn(1 << 18),  # a LayerNorm weight: mean 1, std 1e-4
        torch.randn(70_000) * 0.02,  # above the row-wise norm threshold, not a multiple of a row
    ]


@pytest.mark.parametrize("scale", [None, 2.5, "per-tensor floats", "vector", "tensor", "mixed"])
@pytest.mark.parametrize("centre", [True, False], ids=["centred", "uncentred"])
def test_batch_rows_equal_the_float64_reference(centre, scale):
    xs = tensors()
    factors = {None: [1.0] * len(xs), 2.5: [2.5] * len(xs)}.get(scale, [0.5 + i for i in range(len(xs))])
    given = {"per-tensor floats": factors, "vector": torch.tensor(factors, dtype=torch.float64),
             "tensor": torch.tensor(2.5), "mixed": [torch.tensor(f) if i % 2 else f for i, f in enumerate(factors)]}
    if scale == "tensor":
        factors = [2.5] * len(xs)
    batch = stats.Batch()
    first = batch.add(xs[:4], [centre] * 4, None if scale is None else _part(given.get(scale, scale), 0, 4))
    rest = batch.add(xs[4:], [centre] * (len(xs) - 4),
                     None if scale is None else _part(given.get(scale, scale), 4, len(xs)))
    rows = batch.finish()
    for i, slot in enumerate(first + rest):
        mean, m2 = rows[slot].tolist()
        want_mean, want_m2 = reference(xs[i], factors[i])
        n = stats.count(xs[i])
        std_scale = math.sqrt(max(want_m2, 0.0) / max(n, 1)) + 1e-300
        assert abs(mean - want_mean) <= 1e-6 * (abs(want_mean) + std_scale), (i, mean, want_mean)
        if centre or i != 7:  # uncentred float32 sums cannot resolve the LayerNorm weight's spread
            assert m2 == pytest.approx(want_m2, rel=2e-5, abs=1e-12), (i, m2, want_m2)


@pytest.mark.parametrize("far", [0, 3, 30])
@pytest.mark.parametrize("n", [4096, 65536, 300_000])
def test_a_temporary_keeps_its_norm_and_spread_wherever_its_first_element_lies(far, n):
    """A temporary (``scratch``) of values like stored changes (multiples of 2^-29, a few distinct
    ones: float32 sums of their squares round one way) whose first element lies ``far`` standard
    deviations from the mean: norm and m2 within 1e-5 of float64. Its sums taken about that first
    element lost 1.8e-2 of the norm at 30 (65536 elements)."""
    gen = torch.Generator().manual_seed(n + far)
    x = 2.0**-29 * torch.randn(n, generator=gen).mul(4).round()
    x[0] = 2.0**-29 * round(far * x.double().std().item() / 2.0**-29)
    want_mean, want_m2 = reference(x)
    batch = stats.Batch()
    slot, = batch.add([x.clone()], [False], scratch=True)
    mean, m2 = batch.finish()[slot].tolist()
    assert m2 == pytest.approx(want_m2, rel=1e-5)
    assert math.sqrt(m2 + n * mean**2) == pytest.approx(x.double().norm().item(), rel=1e-5)


def _part(scale, lo, hi):
    if isinstance(scale, list):
        return scale[lo:hi]
    if isinstance(scale, torch.Tensor) and scale.dim() == 1:
        return scale[lo:hi]
    return scale


def test_a_centred_layernorm_weight_keeps_its_std():
    """The issue's case: a weight near 1.0 with std 1e-4 (1M elements) gives its std to 1e-5."""
    torch.manual_seed(0)
    x = 1.0 + 1e-4 * torch.randn(1 << 20)
    batch = stats.Batch()
    slot, = batch.add([x], [True])
    mean, m2 = batch.finish()[slot].tolist()
    table = hosted.MomentTable(torch.tensor([[float(x.numel())]], dtype=torch.float64),
                              torch.tensor([[mean]], dtype=torch.float64), torch.tensor([[m2]], dtype=torch.float64))
    assert table.std.item() == pytest.approx(x.double().std().item(), rel=1e-5)


def test_moment_table_leaves_out_the_std_that_uncentred_sums_lost():
    """Uncentred: a mean-dominated row reads NaN (not logged) and asks to be centred next time;
    a centred one keeps its std. Zero spread also asks for centring; empty rows stay quiet."""
    n = torch.tensor([[1000.0], [1000.0], [1000.0], [0.0]], dtype=torch.float64)
    mean = torch.tensor([[1.0], [1.0], [0.0], [0.0]], dtype=torch.float64)
    m2 = torch.tensor([[1e-3], [1e-3], [0.0], [0.0]], dtype=torch.float64)  # var 1e-6: mean^2/var = 1e6
    uncentred = torch.tensor([[True], [False], [True], [True]])
    table = hosted.MomentTable(n, mean, m2, uncentred)
    std = table.std[:, 0].tolist()
    assert math.isnan(std[0]) and std[1] == pytest.approx(math.sqrt(1e-3 / 999)) and std[2] == 0.0
    assert table.needs_centring[:, 0].tolist() == [True, True, True, True]
    assert table.norm[:, 0].tolist() == pytest.approx([math.sqrt(1e-3 + 1000), math.sqrt(1e-3 + 1000), 0.0, 0.0])
    ratio = hosted.MomentTable(n[:2], torch.tensor([[0.0, 1.0]] * 2, dtype=torch.float64),
                              torch.tensor([[4.0, 1.0], [0.0, 1.0]], dtype=torch.float64)).log10_ratio(0, 1)
    assert ratio[0].item() == pytest.approx(math.log10(2.0)) and math.isnan(ratio[1].item())


def test_large_float32_norm_is_accurate():
    """torch's float32 CPU norm loses 7.5e-4 on 2^24 elements; the row-wise one keeps 1e-6."""
    torch.manual_seed(0)
    x = 0.02 * torch.randn((1 << 24) + 5)
    want = x.double().norm().item()
    batch = stats.Batch()
    slot, = batch.add([x], [False])
    mean, m2 = batch.finish()[slot].tolist()
    assert math.sqrt(m2 + x.numel() * mean * mean) == pytest.approx(want, rel=1e-6)

"""The ``histograms`` family: update, grad and param counts equal numpy's histogram of the clone truth.

Truth: clones of every parameter and grad before ``step()``; after it, ``numpy.histogram`` over
``[-inf, *EDGES, inf]`` of the finite elements of p_after - p_before (formed in float64 from the
stored values), of the grad and of p_after, and their min, max, sum and sum of squares. Counts must
be equal, bin for bin, and the extremes and sums within 1e-6, on the tensors real models have:
LayerNorm weights at exactly 1.0 and biases at 0 (on and around edges), bf16 with many updates lost
to rounding (exact zeros), warm-up learning rates of 1e-7, an empty parameter (no min, no max).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from monitored_optim import MonitorConfig, Monitored
from monitored_optim import histograms as H
from monitored_optim.capture import binning, bits

STEPS = 3


def truth(x: torch.Tensor) -> H.Histogram:
    """numpy's histogram of ``x``'s finite elements over the declared edges (open outer bins), with
    their min and max (None where there is none), sum and sum of squares, in float64."""
    values = x.detach().double().reshape(-1).numpy()
    kept = values[np.isfinite(values)]
    counts = np.histogram(kept, [-np.inf, *H.EDGES, np.inf])[0].tolist()
    low, high = (float(kept.min()), float(kept.max())) if kept.size else (None, None)
    return H.Histogram(counts, low, high, float(kept.sum()), float(np.square(kept).sum()))


def record(h: H.Histogram) -> tuple:
    """Everything a histogram holds: its counts, min, max, sum and sum of squares."""
    return list(h), h.min, h.max, h.sum, h.sum_squares


def assert_exact(got: H.Histogram, want: H.Histogram, tag: str = "", spacing: float = 0.0) -> None:
    """``got`` has ``want``'s counts, its min and max within 1e-6 relative (None alike), its sum of
    squares within 1e-6 relative and its sum within 1e-6 of sqrt(n·Σx²) (which bounds Σ|x|: the
    scale of a sum's rounding where its terms cancel); each element may be off by ``spacing`` more
    (an update rebuilt from the optimizer's state is the stored change within a spacing of p)."""
    assert list(got) == list(want), (tag, np.nonzero(np.subtract(got, want)))
    assert (got.min is None, got.max is None) == (want.min is None, want.max is None), (tag, record(got))
    if want.min is not None:
        assert got.min == pytest.approx(want.min, rel=1e-6, abs=spacing), (tag, got.min, want.min)
        assert got.max == pytest.approx(want.max, rel=1e-6, abs=spacing), (tag, got.max, want.max)
    n, scale = sum(want), math.sqrt(sum(want) * want.sum_squares)  # scale >= Σ|x|
    assert got.sum_squares == pytest.approx(want.sum_squares, rel=1e-6, abs=2 * scale * spacing + n * spacing ** 2), \
        (tag, record(got), record(want))
    assert abs(got.sum - want.sum) <= 1e-6 * scale + n * spacing, (tag, got.sum, want.sum)


def assert_all_exact(got: dict[str, H.Histogram], want: dict[str, H.Histogram],
                     spacing: dict[str, float] | None = None) -> None:
    """The same tags, each histogram :func:`assert_exact` (within ``spacing[tag]`` where given)."""
    assert set(got) == set(want), set(got) ^ set(want)
    for tag, h in want.items():
        assert_exact(got[tag], h, tag, (spacing or {}).get(tag, 0.0))


def spacing(p: torch.Tensor) -> float:
    """A spacing of the floating numbers of ``p``'s dtype at its largest magnitude."""
    return float(torch.finfo(p.dtype).eps * p.detach().abs().max()) if p.numel() else 0.0


class Net(nn.Module):
    """A linear layer with its bias at 0, a LayerNorm at exactly 1.0 and 0, a second linear layer and
    an empty parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 32)
        nn.init.zeros_(self.fc.bias)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.fc(x)))) + self.empty.sum()


def run(opt_cls, dtype, lr, steps=STEPS, step=None, compile="auto", monitor=None, **kwargs):
    """Train ``Net`` in ``dtype`` with a monitored ``opt_cls`` logging histograms at every step (or
    as the ``MonitorConfig`` fields of ``monitor`` say); yield per step (optimizer, the truth per tag)."""
    net = Net().to(dtype)
    opt = Monitored(opt_cls)(net.named_parameters(), lr=lr, **kwargs, monitor=MonitorConfig(
        **{"backend": "none", "every": 1, "figures": "histograms", "compile": compile, **(monitor or {})}))
    stepper = step(opt) if step is not None else opt.step
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, 16, generator=g).to(dtype)
        opt.zero_grad()
        net(x).float().square().mean().backward()
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}
        stepper()
        want = {}
        for n, p in net.named_parameters():
            want[f"update_hist/{n}"] = truth(p.detach().double() - before[n].double())
            want[f"param_hist/{n}"] = truth(p)
            if n in grads:
                want[f"grad_hist/{n}"] = truth(grads[n])
        yield opt, want


OPTIMIZERS = [
    pytest.param(torch.optim.AdamW, {}, id="AdamW"),
    pytest.param(torch.optim.SGD, {"momentum": 0.9}, id="SGD-momentum"),
    pytest.param(torch.optim.Adam, {"foreach": False}, id="Adam-forloop"),
    pytest.param(torch.optim.Adagrad, {}, id="Adagrad"),
    pytest.param(None, {}, id="own-step-clone"),
]


class OwnStep(torch.optim.SGD):
    """A user subclass that overrides ``step``: the clone fallback's route."""

    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize("opt_cls,kwargs", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lr", [1e-3, 1e-7])
def test_counts_equal_numpy_histogram_of_the_clone_truth(opt_cls, kwargs, dtype, lr):
    opt_cls = opt_cls or OwnStep
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "monitored_optim: parameter .* has not changed", RuntimeWarning)
        for opt, want in run(opt_cls, dtype, lr, **kwargs):
            got = opt.monitor.histograms
            assert_all_exact(got, want)
    sizes = {n: p.numel() for n, p in Net().named_parameters()}
    assert all(sum(got[f"update_hist/{n}"]) == sizes[n] for n in sizes)  # every element counted once
    if dtype is torch.bfloat16 and lr == 1e-7:  # bf16 loses these updates: exact zeros, the zero bin
        assert got["update_hist/norm.weight"][H.ZERO] == 32
        assert (got["update_hist/norm.weight"].min, got["update_hist/norm.weight"].max) == (0.0, 0.0)
    assert (got["param_hist/empty"].min, got["param_hist/empty"].max, got["param_hist/empty"].sum) == (None, None, 0.0)


def test_the_edges_are_exact_in_every_dtype_and_values_on_them_go_up():
    """An edge value is the lower end of its bin (numpy's half-open bins), in every dtype; non-finite
    values are not binned; 0, -0.0 and subnormals are in the zero bin."""
    edges = torch.tensor(H.EDGES, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    spread = (torch.randn(100_000, generator=g, dtype=torch.float64)
              * 10.0 ** torch.randint(-16, 9, (100_000,), generator=g))
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for x in (edges, -edges, edges * (1 + 1e-6), edges * (1 - 1e-6), spread):
            assert bits.counts(x.to(dtype)).tolist() == truth(x.to(dtype)), dtype
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, float("inf"), -float("inf"), float("nan"), -float("nan"),
                            1e30, -1e30])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        counts = bits.counts(special.to(dtype))
        assert counts[H.ZERO] == 4 and counts[0] == 1 and counts[-1] == 1 and counts.sum() == 6, dtype
    assert bits.counts(torch.zeros(0)).sum() == 0 and bits.counts(torch.ones(3, dtype=torch.complex64)).sum() == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_finite_path_counts_as_the_general_one(dtype):
    """A CPU tensor without NaN or infinities is binned from finite_keys: the same counts as from keys,
    -0.0 (whose bits wrap round) in the zero bin wherever it lies, the largest and the subnormal
    values of the dtype included. (A tensor holding both -max and max takes the general path: their
    difference overflows.)"""
    g = torch.Generator().manual_seed(1)
    info = torch.finfo(dtype)
    small = torch.tensor([info.tiny, -info.tiny, info.tiny / 2, -info.tiny / 2, 0.0, -0.0], dtype=torch.float64)
    spread = (torch.randn(10_007, generator=g, dtype=torch.float64)
              * 10.0 ** torch.randint(-16, 9, (10_007,), generator=g)).clamp(-info.max, info.max)
    zeros = torch.full((1037,), -0.0, dtype=torch.float64)
    top, bottom = torch.cat([small, small.new_tensor([info.max])]), torch.cat([small, small.new_tensor([-info.max])])
    for x in (top, bottom, small, spread, zeros, torch.cat([spread, zeros, -spread]), zeros[:3]):
        flat = bits.flattened(x.to(dtype), None)
        assert bits.finite_ends(flat) is not None  # the finite path is the one taken
        table = bits.fold(flat.dtype, flat.device)
        general = bits.folded(bits.occurrences(bits.keys(flat), len(table)).view(1, -1), table)[0]
        assert torch.equal(bits.counts(x.to(dtype)), general)
        with np.errstate(over="ignore"):  # the truth's sum of squares of float64's max: only its counts are read
            assert bits.counts(x.to(dtype)).tolist() == truth(x.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_each_element_s_bin_from_its_bits_is_its_key_s_fold_and_numpy_s(dtype):
    """element_bins (the compiled routes' and flat chunks' binning) gives every element the bin its key
    folds to (the eager tally's), and counted they are numpy's: edges and their neighbours, both
    zeros, subnormals, the dtype's largest values, infinities and NaN (NBINS, not binned)."""
    info = torch.finfo(dtype)
    edges = torch.tensor(H.EDGES, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    spread = (torch.randn(20_000, generator=g, dtype=torch.float64)
              * 10.0 ** torch.randint(-16, 9, (20_000,), generator=g)).clamp(-info.max, info.max)
    special = torch.tensor([0.0, -0.0, info.tiny, -info.tiny, info.tiny / 2, -info.tiny / 2, info.max, -info.max,
                            math.inf, -math.inf, math.nan], dtype=torch.float64)
    x = torch.cat([edges, -edges, edges * (1 + 1e-6), edges * (1 - 1e-6), spread, special]).to(dtype)
    bins = binning.element_bins(x)
    assert bins.dtype is torch.uint8
    assert torch.equal(bins.long(), bits.fold(dtype, x.device)[bits.keys(x)])
    assert (bins[-3:] == H.NBINS).all()
    with np.errstate(over="ignore"):  # the truth's sum of squares of float64's max: only its counts are read
        assert torch.bincount(bins.long(), minlength=H.NBINS + 1)[:H.NBINS].tolist() == truth(x)


def test_a_closure_step_bins_the_grads_its_closure_makes():
    """``opt.step(closure)``: the grads the step uses are those the closure makes inside it (stale
    zeros before), and those are binned."""
    net = Net()
    opt = Monitored(torch.optim.SGD)(net.named_parameters(), lr=1e-2,
                                     monitor=MonitorConfig(backend="none", every=1, figures="histograms"))
    made = {}

    def closure():
        opt.zero_grad()
        net(torch.randn(4, 16, generator=torch.Generator().manual_seed(3))).square().mean().backward()
        made.update({n: p.grad.clone() for n, p in net.named_parameters()})
        return 0.0

    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step(closure)
    for n, g in made.items():
        assert_exact(opt.monitor.histograms[f"grad_hist/{n}"], truth(g), n)
    assert sum(opt.monitor.histograms["grad_hist/fc.weight"]) == 16 * 32  # replaced, not added to the stale


def test_a_compiled_step_gives_the_counts_of_the_eager_one():
    """``torch.compile(opt.step)``: the logging step's capture runs outside the compiled graph and
    bins the same tensors, so the counts equal the eager run's and every record (extremes and sums
    too) its own clone truth (the compiled step's arithmetic differs from the eager one's in the last
    bits). ``MonitorConfig(compile=True)`` and ``compile=False`` give the same records: the small
    parameters are binned in their flat chunk either way (the larger ones in
    :func:`test_the_compiled_routes_stay_taken_and_bin_as_the_eager_ones`)."""
    eager = {}
    for compile in (True, False):
        eager[compile] = [{t: record(h) for t, h in opt.monitor.histograms.items()}
                          for opt, _ in run(torch.optim.AdamW, torch.float32, 1e-3, compile=compile)]
        opt = opt_of_last_run(compile)  # held: the monitor reads its optimizer through a weak reference
        routes = opt.monitor.describe().split("capture:", 1)[1]
        assert ", fused" not in routes and "copied flat" in routes, routes  # all small: binned flat
    assert eager[True] == eager[False]
    compiled = []
    for opt, want in run(torch.optim.AdamW, torch.float32, 1e-3, step=lambda o: torch.compile(o.step)):
        assert_all_exact(opt.monitor.histograms, want)
        compiled.append({t: list(h) for t, h in opt.monitor.histograms.items()})
    assert compiled == [{t: counts for t, (counts, *_) in step.items()} for step in eager[True]]


class Wide(nn.Module):
    """Parameters past SMALL: two matrices (the compiled inversion) and a LayerNorm at exactly 1.0 and 0
    (vectors: the compiled snapshot), beside a small bias (a flat chunk)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 4608, bias=False)
        self.norm = nn.LayerNorm(4608)
        self.head = nn.Linear(4608, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.fc(x))))


@pytest.mark.parametrize("opt_cls,kwargs", [(torch.optim.AdamW, {}), (torch.optim.SGD, {"momentum": 0.9})],
                         ids=["AdamW", "SGD-momentum"])
@pytest.mark.parametrize("lr", [1e-3, 1e-7])
def test_the_compiled_routes_stay_taken_and_bin_as_the_eager_ones(opt_cls, kwargs, lr):
    """``MonitorConfig(compile=True)`` with the histograms on: the whole parameters take the compiled
    inversion and snapshot, which bin u, p and the grad in their pass; every record is the clone
    truth's (u within a spacing of p where rebuilt), and the counts are the eager capture's."""
    records = {}
    for compile in (True, False):
        net = Wide()
        opt = Monitored(opt_cls)(net.named_parameters(), lr=lr, **kwargs, monitor=MonitorConfig(
            backend="none", every=1, figures="histograms", compile=compile))
        records[compile] = []
        for i in range(3):
            opt.zero_grad()
            net(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            before = {n: p.detach().clone() for n, p in net.named_parameters()}
            grads = {n: p.grad.clone() for n, p in net.named_parameters()}
            opt.step()
            want = {}
            for n, p in net.named_parameters():
                want.update({f"update_hist/{n}": truth(p.detach().double() - before[n].double()),
                             f"param_hist/{n}": truth(p), f"grad_hist/{n}": truth(grads[n])})
            assert_all_exact(opt.monitor.histograms, want,
                             {f"update_hist/{n}": spacing(p) for n, p in net.named_parameters()})
            records[compile].append({t: list(h) for t, h in opt.monitor.histograms.items()})
        routes = opt.monitor.describe().split("capture:", 1)[1]
        for name in ("fc.weight", "norm.weight", "norm.bias", "head.weight"):
            line = next(line for line in routes.splitlines() if line.startswith(name))
            assert ("fused" in line) == compile, line
    assert records[True] == records[False]


@pytest.mark.parametrize("floor", ["BINS_BYTES", 0])
def test_a_compiled_call_bins_within_its_share_of_the_parameters_or_the_floor(monkeypatch, floor):
    """With the histograms on, the whole parameters go to compiled calls whose bins (a byte per element
    and series) take at most the larger of 1/BINS_SHARE of the whole parameters' bytes and BINS_BYTES,
    or hold one parameter alone: Wide's four whole parameters (405 KB) take one call per route under
    the floor, and one call each without it."""
    from monitored_optim.capture import fused

    if floor == 0:
        monkeypatch.setattr(fused, "BINS_BYTES", 0)
    calls = []
    bin_whole = binning.bin_whole
    monkeypatch.setattr(binning, "bin_whole", lambda part, *rest: (calls.append([e.p.numel() for e in part]),
                                                                 bin_whole(part, *rest))[1])
    net = Wide()
    whole = {n: p.numel() for n, p in net.named_parameters() if p.numel() > fused.SMALL}
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), lr=1e-3, monitor=MonitorConfig(
        backend="none", every=1, figures="histograms", compile=True))
    net(torch.randn(8, 16)).square().mean().backward()
    opt.step()
    assert sorted(n for call in calls for n in call) == sorted(whole.values())
    most = max(4 * sum(whole.values()) // fused.BINS_SHARE, fused.BINS_BYTES)
    assert all(len(call) == 1 or 3 * sum(call) <= most for call in calls)
    assert len(calls) == (2 if floor else 4)
    assert set(opt.monitor.histograms) == {f"{s}/{n}" for s in H.KEYS.values() for n, _ in net.named_parameters()}


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-2}), (torch.optim.SGD, {}),
    (torch.optim.Adam, {"amsgrad": True, "weight_decay": 1e-2, "foreach": False}),
], ids=["SGD-momentum-decay", "SGD", "Adam-amsgrad-L2"])
def test_the_compiled_inversion_stores_as_the_eager_one_and_counts_alike(opt_cls, kwargs):
    """An embedding-like matrix (N(0, 1), most rows without a grad: their update is a few spacings of
    p, often a power of two, on a bin's edge): the compiled inversion rounds p - f·r once, as the
    eager ``torch.sub(p, r, alpha=f)`` and the optimizers' own ``add_(t, alpha=)`` do, so both
    captures count every element in the same bin as numpy does with the clone truth."""
    counts = {}
    for compile in (True, False):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(10000, 64))
        opt = Monitored(opt_cls)([("w", w)], lr=1e-2, **kwargs, monitor=MonitorConfig(
            backend="none", every=1, figures="histograms", compile=compile))
        counts[compile] = []
        for i in range(3):
            g = torch.zeros(10000, 64)
            g[torch.randint(0, 10000, (40,), generator=torch.Generator().manual_seed(i))] = 0.1
            w.grad = g
            before = w.detach().clone()
            opt.step()
            got = opt.monitor.histograms["update_hist/w"]
            assert list(got) == list(truth(w.detach().double() - before.double())), (compile, i)
            counts[compile].append(list(got))
        assert ("fused" in opt.monitor.describe().split("capture:", 1)[1]) == compile
    assert counts[True] == counts[False]


def opt_of_last_run(compile):
    """The optimizer after one logging step of :func:`run` with ``MonitorConfig(compile=compile)``."""
    for opt, _ in run(torch.optim.AdamW, torch.float32, 1e-3, steps=1, compile=compile):
        return opt


def test_histograms_are_off_by_default_and_with_all_on():
    net = Net()
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), lr=1e-3,
                                       monitor=MonitorConfig(backend="none", every=1))
    net(torch.randn(2, 16)).sum().backward()
    opt.step()
    assert opt.monitor.histograms == {} and opt.monitor.latest
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), lr=1e-3,
                                       monitor=MonitorConfig(backend="none", every=1, figures="all"))
    opt.step()
    assert len(opt.monitor.histograms) == 3 * len(list(net.parameters()))
    assert not any("_hist/" in tag for tag in opt.monitor.latest)  # not scalar figures


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, OwnStep])
def test_a_large_parameter_measured_in_parts_is_counted_once_over_its_parts(opt_cls):
    """A matrix larger than a chunk is captured in parts (each part's p, grad and u binned on its
    own); the parts' counts add to the whole matrix's."""
    torch.manual_seed(1)
    net = nn.Linear(1024, 512)
    opt = Monitored(opt_cls)(net.named_parameters(), lr=1e-3,
                             monitor=MonitorConfig(backend="none", every=1, figures="histograms"))
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(4, 1024)).square().mean().backward()
        before, grad = net.weight.detach().clone(), net.weight.grad.clone()
        opt.step()
        assert "in 8 slices" in opt.monitor.describe() or opt_cls is OwnStep
        got = opt.monitor.histograms
        assert_exact(got["update_hist/weight"], truth(net.weight.detach().double() - before.double()))
        assert_exact(got["grad_hist/weight"], truth(grad))
        assert_exact(got["param_hist/weight"], truth(net.weight))


def test_through_the_optimizer_tensorboard_wandb_and_histograms_jsonl_hold_each_step(tmp_path):
    """A monitored run logging to TensorBoard, W&B (offline) and JSONL: each logging step's
    histograms, read back from the event files, the offline run and ``histograms.jsonl``, equal
    ``opt.monitor.histograms`` and the clone truth, with the exact min, max, sum and sum of squares
    of u, the grad and p (W&B: min and max, the drawn edges of the outer bins); the scalars'
    ``metrics.jsonl`` holds none."""
    import json

    from test_histogram_sinks import (
        extent,
        from_edges,
        from_jsonl,
        nonempty,
        tensorboard_histograms,
    )
    from wandb_files import read_rows

    seen = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "monitored_optim: parameter .* has not changed", RuntimeWarning)
        for opt, want in run(torch.optim.AdamW, torch.bfloat16, 1e-7, steps=4, monitor={
                "backend": "tensorboard,wandb,jsonl", "logdir": tmp_path, "every": 2, "figures": "default,histograms"}):
            if opt.monitor.step % 2 == 0:
                seen[opt.monitor.step] = dict(opt.monitor.histograms)
                assert_all_exact(seen[opt.monitor.step], want)
        opt.monitor.close()
    exact = {step: {t: record(h) for t, h in hists.items()} for step, hists in seen.items()}
    rows = [json.loads(line) for line in (tmp_path / "histograms.jsonl").read_text().splitlines()]
    assert {row["step"]: {t: record(from_jsonl(h)) for t, h in row.items() if t not in ("step", "edges")}
            for row in rows} == exact
    written = tensorboard_histograms(tmp_path)
    assert {step: {t: record(h) for t, h in hists.items()} for step, hists in written.items()} \
        == {step: {t: record(h) for t, h in nonempty(hists).items()} for step, hists in seen.items()}
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    shown = {}
    for row in read_rows(run_dir):
        tags = [key[:-len("/_type")] for key, value in row.items() if key.endswith("/_type") and value == "histogram"]
        if tags:
            shown[row["optimizer/step"]] = extent({t: from_edges(row[f"{t}/bins"], row[f"{t}/values"]) for t in tags})
    assert shown == {step: extent(nonempty(h)) for step, h in seen.items()}
    scalars = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in scalars] == [2, 4] and not any("_hist/" in t for row in scalars for t in row)


def test_over_the_tag_budget_the_dashboards_get_depth_groups_added_bin_by_bin(tmp_path):
    """Twelve identical blocks over a tag budget of 40: TensorBoard gets each depth group's counts
    added bin by bin (``update_hist/blocks.*.weight``), ``histograms.jsonl`` every parameter's."""
    import json

    from test_histogram_sinks import dense, nonempty, tensorboard_histograms

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
    named = [(f"blocks.{n}", p) for n, p in net.named_parameters()]
    opt = Monitored(torch.optim.SGD)(named, lr=0.1, monitor=MonitorConfig(
        backend="tensorboard,jsonl", logdir=tmp_path, every=1, figures="update_to_data,histograms", tag_budget=40))
    net(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.monitor.close()
    full = opt.monitor.histograms
    (row,) = [json.loads(line) for line in (tmp_path / "histograms.jsonl").read_text().splitlines()]
    assert {t: dense(h["start"], h["counts"]) for t, h in row.items() if t not in ("step", "edges")} == full
    for series in H.KEYS.values():
        for kind in ("weight", "bias"):
            members = [full[f"{series}/blocks.{i}.{kind}"] for i in range(12)]
            assert tensorboard_histograms(tmp_path)[1][f"{series}/blocks.*.{kind}"] == [sum(c) for c in zip(*members)]
    assert len(tensorboard_histograms(tmp_path)[1]) == len(nonempty({t: [1] for t in full})) // 12



def test_a_small_parameter_without_a_grad_at_a_step_has_no_grad_histogram_then():
    """A parameter binned in a flat chunk that has a grad at one logging step and none at the next:
    its ``grad_hist`` is there, then not (nothing left over from the last step); its update is then
    all exact zeros."""
    torch.manual_seed(0)
    used, spare = nn.Linear(4, 4), nn.Linear(4, 4)
    named = ([(f"used.{n}", p) for n, p in used.named_parameters()]
             + [(f"spare.{n}", p) for n, p in spare.named_parameters()])
    opt = Monitored(torch.optim.AdamW)(named, lr=1e-3, monitor=MonitorConfig(backend="none", every=1,
                                                                          figures="histograms"))
    seen = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(2, 4)
        (used(x) + (spare(x) if step == 0 else 0)).square().sum().backward()
        opt.step()
        seen.append(dict(opt.monitor.histograms))
    assert "copied flat" in opt.monitor.describe()
    assert sum(seen[0]["grad_hist/spare.weight"]) == 16 and "grad_hist/spare.weight" not in seen[2]
    assert seen[2]["update_hist/spare.weight"][H.ZERO] == 16 and sum(seen[2]["update_hist/spare.weight"]) == 16


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
@pytest.mark.parametrize("copies,route", [(1100, "view"), (1, "copied flat")], ids=["eager", "flat"])
def test_a_non_finite_element_leaves_the_other_elements_binned(bad, opt_cls, copies, route):
    """A matrix holding NaN or infinities: the other elements' updates are binned and make the min,
    max and sums, the bad ones do not (health counts them); in the eager route (past SMALL, inverted:
    its bounds are not finite) and in a flat chunk."""
    w = nn.Parameter(torch.tensor([[1.0, 2.0, 3.0, bad], [1.0, 2.0, 3.0, 4.0]]).repeat(1, copies))
    opt = Monitored(opt_cls)([("w", w)], lr=0.5,
                             monitor=MonitorConfig(backend="none", every=1, figures="histograms,health"))
    w.grad = torch.ones_like(w)
    before = w.detach().clone()
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        opt.step()
    assert route in opt.monitor.describe().split("capture:")[1]  # inverted or copied flat
    assert_exact(opt.monitor.histograms["update_hist/w"], truth(w.detach().double() - before.double()))
    assert_exact(opt.monitor.histograms["param_hist/w"], truth(w))  # over the finite elements
    assert_exact(opt.monitor.histograms["grad_hist/w"], truth(w.grad))
    assert sum(opt.monitor.histograms["update_hist/w"]) == w.numel() - copies
    assert opt.monitor.latest["health/nonfinite"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_extent_is_that_of_the_finite_elements(dtype):
    """A tally's min, max, Σx and Σx² of a part are those of its finite elements, with and without
    non-finite ones among them (the CPU's unmasked path and the masked one), where max - min
    overflows, and with none finite; over more than one slice."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(binning.PART_ELEMENTS + 1000, generator=g, dtype=torch.float64) * 1e-3
    big = torch.finfo(dtype).max
    cases = [base, torch.cat([base, torch.tensor([math.nan, math.inf, -math.inf])]),
             torch.tensor([big, -big, 1.0]), torch.tensor([math.nan, math.inf])]
    class Step:  # a logging step's batch, held weakly
        pass

    for x in cases:
        x = x.to(dtype)
        tally, step, owner = binning.Tally(), Step(), object()
        tally.open(step)
        tally.add(owner, "param_hist", x)
        [(_, got)] = tally.pieces()
        summed, low, high = (got[key] for key in H.piece_keys("param_hist"))
        sums = summed[H.NBINS:]
        kept = x.double()[torch.isfinite(x)].numpy()
        if kept.size:
            assert (low.item(), high.item()) == (kept.min(), kept.max())
        else:
            assert (low.item(), high.item()) == (math.inf, -math.inf)
        assert sums.tolist() == pytest.approx([kept.sum(), (kept * kept).sum()], rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_a_tally_adds_the_parts_of_each_owner_into_the_histogram_of_the_whole(dtype):
    """Parts of two owners counted one by one, finite and not, with a part of exact zeros and parts
    whose keys fold through different tables (all finite, or not), give each owner the histogram of
    its parts laid end to end; a dropped series is forgotten, and a new logging step starts empty."""
    g = torch.Generator().manual_seed(0)
    spread = (torch.randn(5000, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-14, 6, (5000,), generator=g))
    edges = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, -0.0, 2.0 ** H.HIGH, -(2.0 ** H.LOW)], dtype=torch.float64)
    bad = torch.tensor([math.nan, math.inf, -math.inf, 3.0], dtype=torch.float64)
    first = [spread[:3000].to(dtype), edges.to(dtype), bad.to(dtype)]
    second = [(-spread[3000:]).to(dtype)]
    class Step:  # a logging step's batch, held weakly
        pass

    tally, step = binning.Tally(), Step()
    tally.open(step)
    a, b = object(), object()
    for part in first:
        tally.add(a, "update_hist", part)
    tally.add_zeros(a, "update_hist", torch.tensor([1.0, -3.0, math.inf, 0.5, math.nan, 2.0, 1e-30, -0.0, 7.0],
                                                   dtype=dtype))  # 7 finite: 7 exact zeros
    tally.add(a, "grad_hist", spread.to(dtype))
    tally.drop(a, "grad_hist")
    for part in second:
        tally.add(b, "param_hist", part)
    got = {(id(owner), key): value for owner, values in tally.pieces() for key, value in values.items()}
    assert {key for _, key in got} == {key for series in ("update_hist", "param_hist") for key in H.piece_keys(series)}
    for owner, series, parts in ((a, "update_hist", [*first, torch.zeros(7, dtype=dtype)]), (b, "param_hist", second)):
        summed, low, high = (got[id(owner), key] for key in H.piece_keys(series))
        hist = H.Histogram(map(round, summed[:H.NBINS].tolist()), low.item(), high.item(), *summed[H.NBINS:].tolist())
        assert_exact(hist, truth(torch.cat(parts)), series)
    assert tally.pieces() == []
    tally.add(a, "update_hist", spread.to(dtype))
    tally.open(Step())  # another logging step: the parts of this one are dropped
    assert tally.pieces() == []


@pytest.mark.parametrize("copies", [1, 1100], ids=["flat", "eager"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_binning_a_non_finite_element_never_writes_into_the_parameter_or_its_grad(copies, dtype):
    """A float64 parameter and grad holding NaN and infinities (whose float64 copy for the sums would
    be the tensor itself): after a monitored step with the histograms on, both are bit for bit the
    plain optimizer's, in a flat chunk and past SMALL."""
    w0 = torch.tensor([[1.0, math.nan], [math.inf, 2.0]], dtype=dtype).repeat(1, copies)
    g0 = torch.tensor([[0.5, 0.5], [-math.inf, math.nan]], dtype=dtype).repeat(1, copies)
    w, plain = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt = Monitored(torch.optim.SGD)([("w", w)], lr=0.1, monitor=MonitorConfig(
        backend="none", every=1, figures="histograms"))
    reference = torch.optim.SGD([plain], lr=0.1)
    w.grad, plain.grad = g0.clone(), g0.clone()
    opt.step()
    reference.step()
    ints = torch.int64 if dtype is torch.float64 else torch.int32  # compared bit for bit
    assert torch.equal(w.detach().view(ints), plain.detach().view(ints))
    assert torch.equal(w.grad.view(ints), plain.grad.view(ints))
    assert sum(opt.monitor.histograms["param_hist/w"]) == copies  # the one finite element of four


@pytest.mark.parametrize("compile", [False, True])
def test_a_layer_without_a_grad_holding_nan_counts_only_its_finite_elements_as_unmoved(compile):
    """An unused layer past SMALL holding NaN and infinities: the step leaves it as it was, so its
    stored change is 0 at each finite element and NaN (x - x) at the others, which are not binned."""
    torch.manual_seed(0)
    used, unused = nn.Parameter(torch.randn(80, 64)), nn.Parameter(torch.randn(80, 64))
    with torch.no_grad():
        unused[0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    opt = Monitored(torch.optim.AdamW)([("used", used), ("unused", unused)], lr=1e-3, monitor=MonitorConfig(
        backend="none", every=1, figures="histograms", compile=compile))
    used.grad = torch.randn(80, 64)
    before = unused.detach().clone()
    opt.step()
    assert_exact(opt.monitor.histograms["update_hist/unused"], truth(unused.detach().double() - before.double()))
    assert sum(opt.monitor.histograms["update_hist/unused"]) == 80 * 64 - 3


@pytest.mark.parametrize("compile", [False, True])
def test_a_snapshotted_change_that_crosses_zero_is_binned_exactly(compile):
    """A vector past SMALL (the snapshot route) stepping from -1.5·2⁻²⁵ to 1 - 2⁻²⁴: its change in
    float32 would round up to 1.0, the next bin; it is formed in float64, as the clone truth is."""
    w = nn.Parameter(torch.full((5000,), -1.5 * 2.0 ** -25))
    opt = Monitored(torch.optim.SGD)([("w", w)], lr=1.0, monitor=MonitorConfig(
        backend="none", every=1, figures="histograms", compile=compile))
    w.grad = torch.full((5000,), -1.0)
    before = w.detach().clone()
    opt.step()
    assert "snapshot" in opt.monitor.describe().split("capture:", 1)[1]
    u = w.detach().double() - before.double()
    assert float(w.detach()[0] - before[0]) == 1.0 and u.max() < 1.0  # the float32 difference crosses the edge
    assert_exact(opt.monitor.histograms["update_hist/w"], truth(u))

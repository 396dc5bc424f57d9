"""The figures equal the clone truth on the tensors real models have.

A grid of dtype {fp32, bf16, fp16} x initialisation {all 1.0, all 0, straddling powers of two,
N(0, 0.02)} x optimizer {SGD, SGD momentum + weight decay, Adam, AdamW with decay, RMSprop,
Adagrad, Adafactor} x lr {1e-2, 1e-4, 3e-7}: each case steps a 512-element vector and a 256 x 512
matrix (both sides of the snapshot rule) several times, and every logging step's figures are
compared with a clone taken here: log10 ratios within 2e-3, norms within 1e-4 relative (fp32) or
1e-3 (bf16/fp16), ``update_lost`` within 0.005 of the fraction of elements that a float64 replay
of the same step moves (for SGD with momentum: whose stored momentum buffer, which torch's step
multiplies by -lr, is not zero) but the stored parameter does not.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import re
import warnings
import zlib

import pytest
import torch

import truth
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.capture import change, compiler, fused, rules
from monitored_optim.workspace import Workspace

O = torch.optim
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INITS = ("ones", "zeros", "straddle", "normal")
OPTIMIZERS = {
    "sgd": (O.SGD, {}),
    "sgd-momentum-wd": (O.SGD, dict(momentum=0.9, weight_decay=1e-2)),
    "adam": (O.Adam, {}),
    "adamw-wd": (O.AdamW, dict(weight_decay=0.1)),
    "rmsprop": (O.RMSprop, {}),
    "adagrad": (O.Adagrad, {}),
    "adafactor": (O.Adafactor, {}),
}
LRS = (1e-2, 1e-4, 3e-7)
STEPS = 3
SHAPES = {"vector": (512,), "matrix": (256, 512)}


def initial(kind: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A parameter as real models start it: LayerNorm gains (1.0), biases (0), values at powers of
    two (each element +-2^k (1 + 2^-10 N(0, 1)), k in {-4..0}: half just below a power of two, where
    a stored value's spacing halves), or a weight matrix's N(0, 0.02)."""
    if kind == "ones":
        x = torch.ones(shape)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "straddle":
        k = torch.randint(-4, 1, shape, generator=gen).double()
        sign = torch.randint(0, 2, shape, generator=gen).double() * 2 - 1
        x = sign * 2.0**k * (1 + 2.0**-10 * torch.randn(shape, generator=gen, dtype=torch.float64))
    else:
        x = 0.02 * torch.randn(shape, generator=gen)
    return x.to(dtype)


def intended_moves(opt: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Where the optimizer means to move each element: the same step replayed on float64 copies of
    the parameters, with the state kept in its own dtype where torch's kernels take that mix (so
    that a bf16 momentum buffer rounds as it does in the real step), else in float64 (bool masks,
    one per parameter)."""
    try:
        return _replay(opt, named, widen=False)
    except RuntimeError:  # e.g. Adam's lerp_ refuses a bf16 moment with a float64 grad
        return _replay(opt, named, widen=True)


def _replay(opt: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]], widen: bool) -> dict[str, torch.Tensor]:
    params = {n: p.detach().double().requires_grad_() for n, p in named}
    for (n, p) in named:
        params[n].grad = p.grad.double()
    groups = []
    for group in opt.param_groups:
        ids = {id(q) for q in group["params"]}
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")},
                       "params": [params[n] for n, p in named if id(p) in ids]})
    replay = type(opt).__mro__[1](groups) if hasattr(opt, "monitor") else type(opt)(groups)
    for n, p in named:
        state = copy.deepcopy(opt.state.get(p, {}))
        replay.state[params[n]] = {k: (v.double() if widen and isinstance(v, torch.Tensor) and v.is_floating_point()
                                       and v.dim() > 0 else v) for k, v in state.items()}
    before = {n: q.detach().clone() for n, q in params.items()}
    replay.step()
    return {n: params[n].detach() != before[n] for n in params}


CASES = list(itertools.product(DTYPES, INITS, OPTIMIZERS, LRS))


@pytest.mark.parametrize("dtype,init,opt_id,lr", CASES, ids=[f"{d}-{i}-{o}-{lr:g}" for d, i, o, lr in CASES])
def test_figures_equal_clone_truth_on_real_initialisations(dtype, init, opt_id, lr, tmp_path):
    check_case(dtype, init, opt_id, lr, tmp_path, compile=False)


def check_case(dtype: str, init: str, opt_id: str, lr: float, tmp_path, compile: bool) -> None:
    """One case of the grid, with the eager capture or the fused one (``compile``)."""
    seed = zlib.crc32(f"{dtype}-{init}-{opt_id}-{lr}-{os.environ.get('GRID_SEED', '')}".encode())
    gen = torch.Generator().manual_seed(seed)  # the same draws in every run (GRID_SEED to try others)
    named = [(name, torch.nn.Parameter(initial(init, shape, DTYPES[dtype], gen))) for name, shape in SHAPES.items()]
    cls, kwargs = OPTIMIZERS[opt_id]
    opt = Monitored(cls)(named, lr=lr, **kwargs, monitor=MonitorConfig(backend="none", logdir=tmp_path,
                                                                        compile=compile))
    low = DTYPES[dtype] != torch.float32
    tol = dict(ratio_tol=2e-3, norm_rtol=1e-3 if low else 1e-4)
    for _ in range(STEPS):
        for _, p in named:
            p.grad = (1e-2 * torch.randn(p.shape, generator=gen)).to(p.dtype)
        before, grads = truth.snapshot(named)
        moves = intended_moves(opt, named) if low else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")  # its compiler's own
            opt.step()
        if low and opt_id == "sgd-momentum-wd":  # torch's step is p -= lr * buf: it means to move where
            moves = {n: opt.state[p]["momentum_buffer"] != 0 for n, p in named}  # its stored buffer is not 0
        logged = opt.monitor.latest
        expected = truth.figures(named, before, grads)
        for w in caught:  # only the health warnings these inputs call for
            assert re.search(r"has not changed for 3 logging steps|NaN or Inf", str(w.message)), w.message
            assert "NaN or Inf" not in str(w.message) or expected["health/nonfinite"] > 0, w.message
        lost = {k: v for k, v in logged.items() if k.startswith("update_lost/")}
        truth.assert_figures_match({k: v for k, v in logged.items() if k not in lost}, expected, **tol)
        if low:
            for name, p in named:
                want = (moves[name] & (p.detach() == before[name])).double().mean().item()
                assert abs(lost[f"update_lost/{name}"] - want) <= 0.005, (name, lost, want)


@pytest.mark.parametrize("opt_id", ["sgd", "adam", "adamw-wd"])
def test_aliased_parameters_report_the_change_of_their_storage(opt_id, tmp_path):
    """A tied weight listed twice (``named_parameters(remove_duplicate=False)``: torch steps it twice)
    and two Parameters over overlapping pieces of one storage: each name's figures are the change of
    what that name holds, as a clone of it sees it."""
    gen = torch.Generator().manual_seed(0)
    tied = torch.nn.Parameter(0.02 * torch.randn(64, 32, generator=gen))
    base = 0.02 * torch.randn(4096, generator=gen)
    low, high = torch.nn.Parameter(base[:3000].view(100, 30)), torch.nn.Parameter(base[1096:].view(100, 30))
    named = [("tied", tied), ("tied_again", tied), ("low", low), ("high", high)]
    cls, kwargs = OPTIMIZERS[opt_id]
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = Monitored(cls)(named, lr=1e-2, **kwargs, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    for _ in range(2):
        for _, p in named:
            p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
        before, grads = truth.snapshot(named)
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))


FAR_FIRST = (5.0, 30.0)
"""How many grad standard deviations grad[0, 0] lies above the rest at every step (fp32, N(0, 0.02),
SGD with momentum at lr 3e-7), so that the first element of the update lies about that far from
its mean."""


@pytest.mark.parametrize("far", FAR_FIRST, ids=[f"{far:g}-std" for far in FAR_FIRST])
def test_an_update_whose_first_element_lies_far_from_its_mean_equals_clone_truth(far, tmp_path):
    """``proj.weight``, 512 x 256 float32, its update rebuilt in two slices of 65536 elements, the
    first element of each far from the slice's mean (sums taken about it would lose the float32
    rounding of Σ(x - c)^2 many times over): every step's figures within the clone truth's tolerances."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"far-first-{far}".encode()))
    named = [("proj.weight", torch.nn.Parameter(initial("normal", (512, 256), torch.float32, gen)))]
    opt = Monitored(O.SGD)(named, lr=3e-7, momentum=0.9, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    for _ in range(STEPS):
        grad = 1e-2 * torch.randn(512, 256, generator=gen)
        grad[0, 0] += far * 1e-2
        named[0][1].grad = grad
        before, grads = truth.snapshot(named)
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))


HOSTILE = [
    ("nadam-small-lr", O.NAdam, dict(lr=1e-6), "normal1", (64, 128), 1),
    ("nadam-foreach-decoupled", O.NAdam, dict(lr=1e-6, foreach=True, weight_decay=0.1,
                                              decoupled_weight_decay=True), "normal1", (64, 128), 1),
    ("nadam-l2", O.NAdam, dict(lr=1e-4, weight_decay=0.1), "normal1", (64, 128), 1),
    ("asgd-large-lambd", O.ASGD, dict(lr=1e-6, lambd=1.0), "normal1", (64, 128), 1),
    ("asgd-large-lambd-1e-4", O.ASGD, dict(lr=1e-4, lambd=1.0, weight_decay=0.1), "normal1", (64, 128), 1),
    ("sgd-ones-every3", O.SGD, dict(lr=1e-7), "ones", (64, 128), 3),
    ("adam-ones-every3-parts", O.Adam, dict(lr=1e-6), "ones", (600, 500), 3),
    ("adam-ones-but-one", O.Adam, dict(lr=1e-6), "ones-but-one", (64, 128), 1),
    ("rmsprop-transposed-large", O.RMSprop, dict(lr=1e-3), "transposed", (1000, 600), 1),
    ("adam-transposed-large", O.Adam, dict(lr=1e-3), "transposed", (1000, 600), 1),
    ("adafactor-large-rows", O.Adafactor, dict(lr=1e-2), "normal1", (600, 500), 1),
    ("adafactor-large-rows-wd-small-lr", O.Adafactor, dict(lr=1e-6, weight_decay=0.1), "normal1", (600, 500), 1),
    ("adafactor-large-rows-foreach-maximize", O.Adafactor, dict(lr=1e-3, foreach=True, maximize=True),
     "normal1", (1000, 300), 1),
]
"""Cases a hostile review found off: NAdam and ASGD store p twice per step; matrices near constant
at their first logging step; large non-contiguous parameters. Also Adafactor's large matrices, rebuilt
a block of rows at a time."""


@pytest.mark.parametrize("cid,cls,kwargs,init,shape,every", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_cases_equal_clone_truth(cid, cls, kwargs, init, shape, every, tmp_path):
    gen = torch.Generator().manual_seed(zlib.crc32(cid.encode()))
    if init == "normal1":
        w = torch.randn(shape, generator=gen)
    elif init == "transposed":
        w = torch.randn(shape, generator=gen).t()
    else:
        w = torch.ones(shape)
        if init == "ones-but-one":
            w[0, 0] = 0.5
    named = [("w", torch.nn.Parameter(w))]
    opt = Monitored(cls)(named, **kwargs, monitor=MonitorConfig(backend="none", every=every, logdir=tmp_path))
    for step in range(1, 2 * every + 1):
        named[0][1].grad = 1e-2 * torch.randn(named[0][1].shape, generator=gen)
        before, grads = truth.snapshot(named)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        if step % every == 0:
            truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))
            assert not caught, [str(w.message) for w in caught]


@pytest.mark.parametrize("cls,kwargs", [(O.SGD, dict(lr=1e-6)), (O.Adam, dict(lr=1e-6)), (O.Adagrad, dict(lr=1e-6))],
                         ids=["sgd", "adam", "adagrad"])
def test_complex_parameter_update_norm_equals_clone_truth(cls, kwargs, tmp_path):
    """A complex matrix initialised at 1 + 0j: its norm counts real and imaginary parts alike."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.ones(64, 128, dtype=torch.complex64))
    opt = Monitored(cls)([("w", w)], **kwargs, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    for _ in range(3):
        w.grad = 1e-2 * torch.randn(w.shape, dtype=torch.complex64, generator=gen)
        before = w.detach().clone()
        opt.step()
        true = torch.view_as_real(w.detach()).double() - torch.view_as_real(before).double()
        assert opt.monitor.latest["update_norm/w"] == pytest.approx(true.norm().item(), rel=1e-4)


def _at_powers_of_two(kind: str, gen: torch.Generator) -> torch.Tensor:
    """A matrix with some elements exactly at a power of two: half of it at 1.0 (the rest N(0, 1)),
    the identity (``nn.init.eye_``), N(0, 1) clipped to [-1, 1], or ±2^k for k in -6..-1."""
    if kind == "eye":
        return torch.eye(256, 256)
    if kind == "powers":  # quantization-aware training's values
        sign = torch.randint(0, 2, (256, 256), generator=gen) * 2.0 - 1
        return sign * 2.0 ** torch.randint(-6, 0, (256, 256), generator=gen)
    w = torch.randn(256, 256, generator=gen)
    if kind == "clipped":
        return w.clamp(-1, 1)
    w.view(-1)[:w.numel() // 2] = 1.0
    return w


POWERS_OF_TWO = [
    ("adamw-half-ones", O.AdamW, dict(lr=1e-7, weight_decay=0.01), "half-ones", "randn"),
    ("adamw-eye", O.AdamW, dict(lr=1e-7, weight_decay=0.01), "eye", "randn"),
    ("sgd-momentum-half-ones", O.SGD, dict(lr=1e-7, momentum=0.9), "half-ones", "randn"),
    ("sgd-momentum-eye", O.SGD, dict(lr=1e-7, momentum=0.9), "eye", "randn"),
    ("adamw-eye-stuck", O.AdamW, dict(lr=5e-8), "eye", "minus-one"),
    ("radam-eye", O.RAdam, dict(lr=1e-6), "eye", "randn"),
    ("adamw-clipped", O.AdamW, dict(lr=1e-5), "clipped", "randn"),
    ("nadam-clipped", O.NAdam, dict(lr=1e-7), "clipped", "randn"),
    ("rprop-powers", O.Rprop, dict(lr=1e-6), "powers", "randn"),
]
"""Cases hostile reviews found off: the identity's 1.0s stuck under updates below half a spacing
(grad -1 at lr 5e-8; RAdam's rectified early steps), weights clipped to [-1, 1] after every step
(NAdam has no fused form: ``compile=True`` runs its eager capture), ±2^k values that Rprop's steps
bring back onto powers of two after a quiet logging step."""


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("cid,cls,kwargs,kind,grad", POWERS_OF_TWO, ids=[c[0] for c in POWERS_OF_TWO])
def test_matrices_partly_at_a_power_of_two_equal_clone_truth(cid, cls, kwargs, kind, grad, compile, tmp_path):
    """Elements exactly at a power of two in a matrix that is not near-constant as a whole: an update
    below their spacing leaves them there or moves them across, where the inversion cannot tell the
    two stored neighbours apart. Found when the optimizer is built and measured at every logging
    step after (``capture.at_powers_of_two``), they keep the matrix snapshotted over 20 steps (a
    first version released it after 8 quiet logging steps, and then missed by up to 2.8e-3 of the
    norm). Every logging step's figures within the tolerances of the clone truth."""
    gen = torch.Generator().manual_seed(zlib.crc32(cid.encode()))
    named = [("w", torch.nn.Parameter(_at_powers_of_two(kind, gen)))]
    opt = Monitored(cls)(named, **kwargs, monitor=MonitorConfig(backend="none", compile=compile, logdir=tmp_path))
    for _ in range(20):
        named[0][1].grad = torch.randn(256, 256, generator=gen) if grad == "randn" else -torch.ones(256, 256)
        before, grads = truth.snapshot(named)
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))
        if kind == "clipped":  # weight clipping after each step, as a user's loop does it
            with torch.no_grad():
                named[0][1].clamp_(-1, 1)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "fused"])
def test_powers_of_two_measured_before_a_step_send_a_matrix_to_the_snapshot(compile, tmp_path):
    """Half a matrix set to 1.0 after the optimizer is built (so not found then): AdamW's first step
    from exactly 1.0 at lr 1e-7 inverts exactly; what the capture measures before it (the fused
    pass's sum, the eager inversion's bound) snapshots the matrix from the second logging step on.
    Every logging step within the clone truth's tolerances."""
    gen = torch.Generator().manual_seed(0)
    named = [("w", torch.nn.Parameter(torch.randn(256, 256, generator=gen)))]
    opt = Monitored(O.AdamW)(named, lr=1e-7, weight_decay=0.01,
                             monitor=MonitorConfig(backend="none", compile=compile, logdir=tmp_path))
    with torch.no_grad():
        named[0][1].view(-1)[:256 * 128] = 1.0
    assert "rounding risk" not in opt.monitor.describe()
    for _ in range(12):
        named[0][1].grad = torch.randn(256, 256, generator=gen)
        before, grads = truth.snapshot(named)
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))
    assert "rounding risk" in opt.monitor.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_at_powers_of_two_sums_the_squares_of_elements_at_a_power_of_two_before_or_after(dtype):
    """``capture.at_powers_of_two`` against frexp's mantissa of ±0.5 (a power of two) and 0: values at
    powers of two moving down, up or not at all, random values, zeros that move."""
    gen = torch.Generator().manual_seed(0)
    powers = 2.0 ** torch.randint(-6, 4, (300,), generator=gen).to(dtype)
    before = torch.cat([powers, -powers, powers, torch.randn(300, generator=gen, dtype=dtype),
                        torch.zeros(100, dtype=dtype)]).reshape(20, 65)
    step = torch.cat([-1e-4 * powers, 1e-4 * powers, torch.zeros(300, dtype=dtype),
                      1e-3 * torch.randn(300, generator=gen, dtype=dtype), torch.full((100,), 2e-6, dtype=dtype)])
    after = before + step.reshape(20, 65)
    exact = (torch.frexp(before).mantissa.abs() % 0.5 == 0) | (torch.frexp(after).mantissa.abs() % 0.5 == 0)
    assert int(exact.sum()) == 1000
    want = after[exact].double().square().sum().item()
    assert rules.at_powers_of_two(before, after).item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mantissa_gap_is_zero_exactly_where_the_bits_have_no_mantissa(dtype):
    """``capture.mantissa_gap`` against the bits: 0 at every normal power of two and ±0; nonzero with
    the lowest or the highest mantissa bit alone or random mantissas, at every exponent from 2^-102
    (float32; 2^-969 float64) up, with and without ``out``, over seeds; ±inf and NaN give NaN."""
    ints, width = {torch.float32: (torch.int32, 23), torch.float64: (torch.int64, 52)}[dtype]
    info = torch.finfo(dtype)
    lowest = int(math.log2(info.tiny))  # the normal exponents: lowest to 1 - lowest
    powers = 2.0 ** torch.arange(lowest, 2 - lowest, dtype=torch.float64).to(dtype)
    assert (rules.mantissa_gap(torch.cat([powers, -powers, torch.tensor([0.0, -0.0], dtype=dtype)])) == 0).all()
    spaced = powers[width + 1:]  # x·2^-(width + 1) is a normal number, exact
    for seed in range(20):
        mantissas = 1 + torch.rand(spaced.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        values = torch.cat([spaced * (1 + info.eps), spaced * (2 - info.eps), spaced * mantissas.to(dtype)])
        values = torch.cat([values, -values])
        has_bits = (values.view(ints) & ((1 << width) - 1)) != 0
        for out in (None, torch.empty_like(values)):
            gap = rules.mantissa_gap(values, out)
            assert torch.equal(gap != 0, has_bits) and (out is None or gap is out)
        assert int(has_bits.sum()) >= 4 * spaced.numel()
    assert rules.mantissa_gap(torch.tensor([math.inf, -math.inf, math.nan], dtype=dtype)).isnan().all()


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_the_compiled_power_of_two_sums_keep_ieee_rounding_under_unsafe_math():
    """``fused.prior`` compiled with inductor's unsafe-math flag switched on by the user: its power-of-two
    sums still equal the eager ones (GCC's -funsafe-math-optimizations made fl(x + x·h) - x into x·h,
    never 0; ``compiler.INDUCTOR`` switches it off)."""
    xs = [torch.ones(64, 64), torch.eye(32) + 0.5 * torch.eye(32).roll(1, 0)]
    torch._dynamo.reset()
    with torch._inductor.config.patch({"cpp.enable_unsafe_math_opt_flag": True}):
        got = torch.compile(fused.prior, dynamic=True, options=compiler.INDUCTOR)(xs)
    torch._dynamo.reset()
    assert got[:, 5].tolist() == fused.prior(xs)[:, 5].tolist() == [4096.0, 32.0 * 1.25]
    assert torch.tensor(1e-40) * 1.0 != 0  # subnormals still work in this process


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("cls", [O.AdamW, O.SGD], ids=["adamw", "sgd"])
def test_clipping_that_starts_after_the_build_is_snapshotted_from_the_next_logging_step(cls, compile, tmp_path):
    """N(0, 1) weights clipped to [-0.5, 0.5] after every step from the first on (not at the build):
    the logging step after the first clip inverts them (its measurement comes before that step, the
    decision before it: off by up to 2.4e-2 of the norm at lr 1e-7, the documented lag), every one
    after that is snapshotted and within the clone truth's tolerances."""
    gen = torch.Generator().manual_seed(1)
    named = [("w", torch.nn.Parameter(torch.randn(256, 256, generator=gen)))]
    opt = Monitored(cls)(named, lr=1e-7, monitor=MonitorConfig(backend="none", compile=compile, logdir=tmp_path))
    for step in range(1, 13):
        named[0][1].grad = torch.randn(256, 256, generator=gen)
        before, grads = truth.snapshot(named)
        opt.step()
        if step != 2:
            truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))
        with torch.no_grad():
            named[0][1].clamp_(-0.5, 0.5)
    assert "rounding risk" in opt.monitor.describe()


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided-vector"])
def test_at_powers_of_two_bound_counts_nonzero_powers_of_two(layout):
    """``capture.at_powers_of_two_bound``: the count of nonzero elements exactly at a power of two
    (zeros left out: they invert exactly) times the largest p², at least the exact sum; none for a
    part larger than the workspace's buffer."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 500, generator=gen)
    x.view(-1)[::7] = 2.0 ** torch.randint(-4, 2, (x.numel() // 7 + 1,), generator=gen).float()
    x.view(-1)[3::11] = 0.0
    x = {"contiguous": x, "transposed": x.t(), "strided-vector": x.view(-1)[::2]}[layout]
    bits = x.contiguous().view(torch.int32)
    count = int((((bits & ((1 << 23) - 1)) == 0) & (x.contiguous() != 0)).sum())
    want = count * x.abs().max().item() ** 2
    got = rules.at_powers_of_two_bound(x, change.bounds(x), Workspace(x.numel() * 4)).item()
    assert got == pytest.approx(want, rel=1e-6)  # the largest |p| squared in float32
    assert got >= rules.at_powers_of_two(x, x).item()
    assert rules.at_powers_of_two_bound(x, change.bounds(x), Workspace(x.numel() * 4 - 4)) is None


@pytest.mark.parametrize("value", [1.0, -0.5, 0.0])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("cls", [O.AdamW, O.SGD], ids=["adamw", "sgd"])
def test_a_matrix_filled_with_a_constant_after_the_build_is_inverted_exactly(cls, compile, value, tmp_path):
    """N(0, 1) weights set to one constant between two logging steps (a re-initialisation, after the
    snapshot rule measured them spread): that logging step still inverts them, and p_before is
    known to be the constant from its min and max alone, so its update norm equals the clone
    truth's at lr 1e-7, whose steps cross the power of two at 1.0 and -0.5."""
    gen = torch.Generator().manual_seed(2)
    named = [("w", torch.nn.Parameter(torch.randn(256, 256, generator=gen)))]
    opt = Monitored(cls)(named, lr=1e-7, monitor=MonitorConfig(backend="none", compile=compile, logdir=tmp_path))
    for step in range(1, 5):
        if step == 4:
            with torch.no_grad():
                named[0][1].fill_(value)
        named[0][1].grad = torch.randn(256, 256, generator=gen)
        before, grads = truth.snapshot(named)
        opt.step()
        want = truth.figures(named, before, grads)
        if step == 4:  # the norms: a constant's ratios are undefined (its one-pass moments say withheld)
            want = {tag: value for tag, value in want.items() if "norm" in tag}
        truth.assert_figures_match({tag: opt.monitor.latest[tag] for tag in want} if step == 4
                                   else opt.monitor.latest, want)
    assert "rounding risk" not in opt.monitor.describe().split("next:")[0]  # step 4 took the inversion

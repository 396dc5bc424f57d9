"""Overhead of monitoring, measured side by side in one process on a small transformer language model.

    python benchmarks/overhead.py [--quick] [--rounds 8] [--optimizers adamw,sgd] [--device cpu]

Modes, run in interleaved rounds of ten iterations each, so that drift of the shared machine hits
all of them alike:

* ``plain``: the optimizer alone;
* ``floor``: the optimizer plus, after each step, one read of every parameter, grad and state tensor
  (``torch._foreach_norm``, one kernel per tensor): the least any monitor that reads them costs;
* ``fused kernels``: the optimizer plus the fused capture's tensor work alone (its compiled passes
  and flat chunk, :func:`fused_kernels_hooks`), with none of its Python bookkeeping: the least the
  fused capture costs, its design unchanged;
* ``eager kernels``: the optimizer plus the least tensor work of an exact eager capture, one ATen op
  per quantity per part, in its cheapest measured form (:func:`eager_kernels_hooks`): the least the
  eager capture can cost, the same way;
* ``clone-diff``: the usual hooks (a step pre-hook clones every parameter, a post-hook diffs and calls
  ``.item()`` per parameter for its update-to-data ratio);
* ``eager every=1``: ``Monitored(cls)`` with the eager capture (``compile=False``) logging every step;
* ``fused every=1`` / ``fused every=10``: the fused capture (``compile=True``) logging on every /
  every tenth step (backend none). Its graphs are compiled in the warm-up, before any timing, and
  the compile time is printed.

Prints, per optimizer, the step time and the full-iteration time (forward, backward, step) as ratios
to ``plain`` (the median over rounds of each round's mean, so every=10 is amortized over its one
logging step in ten), the extra peak memory of one logging step as a fraction of parameter bytes
(the profiler's allocation events, ``benchmarks/memory.py``'s ``allocated_peak``), then one logging
step on a model of 2,000 small tensors per optimizer (with ``fused kernels`` there as its bound), and
each of the issue's targets as met, NOT met, impossible here (``fused kernels`` or ``eager kernels``
alone, or ``floor``, already costs more than the target allows) or noise (a ratio that load on the
machine made impossible: a mode that does more than plain measured faster than it, or a mode below
its own bound). An iteration target is judged on the larger of the measured iteration and the one
its step time gives (:func:`judged`). ``--quick`` runs 3 rounds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import allocated_peak  # noqa: E402

from torch._utils import _flatten_dense_tensors  # noqa: E402

from monitored_optim import Monitored, MonitorConfig  # noqa: E402
from monitored_optim.capture import change, fused  # noqa: E402
from monitored_optim.capture.compiler import Fuser  # noqa: E402
from monitored_optim.updates import view_for  # noqa: E402

VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH = 2000, 128, 6, 4, 64, 16


class TinyLM(nn.Module):
    """Embedding, LAYERS pre-norm encoder layers, output head: 2 + 12 * LAYERS + 1 = 75 tensors."""

    def __init__(self, vocab=VOCAB, width=WIDTH, layers=LAYERS, heads=HEADS):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


def clone_diff_hooks(opt, named):
    """The hand-written approach: clone before step(), diff after, one .item() per parameter."""
    saved, ratios = {}, {}

    def pre(o, args, kwargs):
        for name, p in named:
            saved[name] = p.detach().clone()

    def post(o, args, kwargs):
        for name, p in named:
            u = p.detach() - saved[name]
            ratios[name] = math.log10((u.std() / p.detach().std()).item() + 1e-30)
        saved.clear()

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)


def read_once_hook(opt):
    """The floor: one read of every parameter, grad and state tensor after each step."""

    def post(o, args, kwargs):
        tensors = [p for g in o.param_groups for p in g["params"]]
        tensors += [p.grad for p in tensors if p.grad is not None]
        tensors += [v for s in o.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        torch._foreach_norm(tensors)

    opt.register_step_post_hook(post)


def flat_chunks(params):
    """The capture's flat chunks of the small ones of ``params`` (``fused.flat_chunks``): the lists of
    parameters and their lengths (int64 tensors on their device)."""
    small = [p for p in params if p.numel() <= fused.SMALL]
    flats = [small[span.start:span.stop] for span in fused.flat_chunks([p.numel() for p in small])]
    return flats, [torch.tensor([p.numel() for p in ps], device=ps[0].device) for ps in flats]


def flat_rows(flats, befores, lengths):
    """After the step, each flat chunk's rows as the capture takes them: its flattens and ``fused.flat``."""
    return [fused.flat(before, _flatten_dense_tensors(ps), _flatten_dense_tensors([p.grad for p in ps]), n)
            for ps, before, n in zip(flats, befores, lengths)]


def fused_kernels_hooks(opt):
    """The fused capture's tensor work alone, with none of its bookkeeping, in the fused capture's
    chunks (one param group, device and dtype, as in this benchmark's models): before the step each
    flat chunk's copy of the small parameters (``fused.flat_chunks``) and ``fused.prior`` of each
    chunk of up to ``fused.CHUNK`` large ones of one rank; after it, per chunk, the view's fused form
    and ``fused.inverted``, and per flat chunk its flattens and ``fused.flat``; compiled as the fused
    capture compiles them. What a fused logging step costs above this is Python per parameter."""
    fuser, view, (group,) = Fuser("on"), view_for(type(opt)), opt.param_groups
    ranks = {}
    for p in group["params"]:
        if p.numel() > fused.SMALL:
            ranks.setdefault(p.dim(), []).append(p)
    chunks = [ps[i:i + fused.CHUNK] for ps in ranks.values() for i in range(0, len(ps), fused.CHUNK)]
    flats, lengths = flat_chunks(group["params"])
    held = {}

    @torch.no_grad()
    def pre(o, args, kwargs):
        held["before"] = [fused.flat_copy(ps) for ps in flats]
        held["prior"] = [fuser(fused.prior, ps, device=ps[0].device) for ps in chunks]

    @torch.no_grad()
    def post(o, args, kwargs):
        for ps, prior in zip(chunks, held["prior"]):
            form = view.fused(group, ps, [o.state[p] for p in ps])
            if form is not None:  # the first step creates the state
                fuser(fused.inverted, *form, prior[:, :2].contiguous(), ps, [p.grad for p in ps], device=ps[0].device)
        flat_rows(flats, held["before"], lengths)

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)


def eager_kernels_hooks(opt):
    """The least tensor work of an exact eager capture, for this benchmark's AdamW (decoupled weight
    decay) and SGD momentum: per part of a large parameter (``capture.budget``'s elements, the eager
    capture's chunk), one ATen op per quantity it must have, in its cheapest measured form:

    * before the step: ``aminmax`` (a constant p_before, which the inversion cannot recover where
      the step crosses a power of two), ``bitwise_and`` and ``count_nonzero`` (the elements at a
      power of two, the rounding-risk measure), ``sum`` and ``vector_norm`` of p and of the grad;
    * after it: the rebuild of the update from state (AdamW: ``sqrt``, ``add_`` of eps·b, ``div`` of
      m; SGD: none, the momentum buffer is the update), one op inverting the store
      (``sub``/``add`` with alpha; AdamW then ``div_`` by 1 - lr·λ), two restoring a constant
      (``mul_``, ``add_``), ``sub`` for u = p_after - p_before, ``sum`` and ``vector_norm`` of u;

    the small parameters' flat chunks as the capture does them (one copy before, the flattens and
    ``fused.flat`` after), and one host copy of all sums. No bookkeeping: what an eager logging step
    costs above this is its Python and the ops it spends on more than these.

    Returns the dict whose ``"host"`` holds, after each step, the host values: per part of each large
    parameter in order its power-of-two count and p's and the grad's sum and norm, then per part u's
    sum and norm, then the flat chunks' rows (``tests/test_benchmarks.py`` checks u against a clone)."""
    (group,) = opt.param_groups
    params = group["params"]
    limit = change.budget(sum(p.numel() * p.element_size() for p in params)) // 4
    flats, lengths = flat_chunks(params)
    large = [p for p in params if p.numel() > fused.SMALL]
    adam = isinstance(opt, torch.optim.AdamW)
    if not adam and not (type(opt) is torch.optim.SGD and group["momentum"] and not group["nesterov"]):
        raise NotImplementedError(f"eager kernels: {type(opt).__name__} is not this benchmark's AdamW or SGD momentum")
    held, work = {}, torch.empty(limit, dtype=torch.int32, device=params[0].device)

    def parts(t):
        flat = t.detach().reshape(-1)
        return [flat[i:i + limit] for i in range(0, flat.numel(), limit)]

    @torch.no_grad()
    def pre(o, args, kwargs):
        held["before"] = [fused.flat_copy(ps) for ps in flats]
        held["bounds"], sums = [], []
        for p in large:
            for x, g in zip(parts(p), parts(p.grad)):
                held["bounds"].append(torch.aminmax(x))
                bits = torch.bitwise_and(x.view(torch.int32), (1 << 23) - 1, out=work[:x.numel()])
                sums += [torch.count_nonzero(bits),
                         x.sum(), torch.linalg.vector_norm(x), g.sum(), torch.linalg.vector_norm(g)]
        held["sums"] = sums

    @torch.no_grad()
    def post(o, args, kwargs):
        sums, bounds = held["sums"], iter(held["bounds"])
        for p in large:
            state = o.state[p]
            if adam:
                step = float(state["step"])
                b = (1 - group["betas"][1] ** step) ** 0.5
                c, s = -group["lr"] / (1 - group["betas"][0] ** step) * b, 1 - group["lr"] * group["weight_decay"]
                stored = zip(parts(p), parts(state["exp_avg"]), parts(state["exp_avg_sq"]))
            else:
                stored = ((x, m, None) for x, m in zip(parts(p), parts(state["momentum_buffer"])))
            for x, m, v in stored:
                lo, hi = next(bounds)
                if adam:
                    t = torch.sqrt(v).add_(group["eps"] * b)
                    torch.div(m, t, out=t)
                    torch.sub(x, t, alpha=c, out=t).div_(s)
                else:
                    t = torch.add(x, m, alpha=group["lr"])
                t.mul_(lo != hi).add_(lo * (lo == hi))
                torch.sub(x, t, out=t)
                sums += [t.sum(), torch.linalg.vector_norm(t)]
        rows = flat_rows(flats, held["before"], lengths)
        held["host"] = torch.cat([torch.stack(sums).double(), *(r.reshape(-1) for r in rows)]).tolist()

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    return held


def build(mode, cls, kwargs, device, model_fn=None):
    torch.manual_seed(0)
    model = (model_fn or TinyLM)().to(device)
    named = list(model.named_parameters())
    if mode in ("plain", "clone-diff", "floor", "fused kernels", "eager kernels"):
        opt = cls(named, **kwargs)
        hooks = {"clone-diff": lambda o: clone_diff_hooks(o, named), "floor": read_once_hook,
                 "fused kernels": fused_kernels_hooks, "eager kernels": eager_kernels_hooks}
        if mode in hooks:
            hooks[mode](opt)
    else:
        capture, every = mode.split(" every=")
        opt = Monitored(cls)(named, **kwargs, monitor=MonitorConfig(backend="none", every=int(every),
                                                                    compile=capture == "fused"))
    return model, opt


def iteration(model, opt, tokens, timings):
    t0 = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    _sync(tokens)
    t1 = time.perf_counter()
    opt.step()
    _sync(tokens)
    t2 = time.perf_counter()
    timings["step"].append(t2 - t1)
    timings["iter"].append(t2 - t0)


def interleaved(built: dict, tokens, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per mode of ``built`` (mode -> (model, optimizer)), the median over ``rounds`` rounds of the mean
    ``opt.step()`` time and of the mean iteration time, in seconds; each round runs ten iterations of
    every mode in turn, after one round of warm-up."""
    steps: dict[str, list[float]] = {mode: [] for mode in built}
    iters: dict[str, list[float]] = {mode: [] for mode in built}
    for r in range(rounds + 1):  # round 0 warms up
        for mode, (model, opt) in built.items():
            timings: dict[str, list[float]] = {"step": [], "iter": []}
            for _ in range(10):
                iteration(model, opt, tokens, timings)
            if r:
                steps[mode].append(statistics.mean(timings["step"]))
                iters[mode].append(statistics.mean(timings["iter"]))
    return ({mode: statistics.median(v) for mode, v in steps.items()},
            {mode: statistics.median(v) for mode, v in iters.items()})


def tinylm_modes(doc: str, modes: dict, build) -> tuple[dict[str, float], dict[str, float]]:
    """Parse ``--rounds`` and ``--device``, build each of ``modes`` (``build(mode, device)`` -> (model,
    optimizer)) and time them in :func:`interleaved` rounds on one batch of TinyLM tokens; print the
    header and each mode's step and iteration time beside ``plain``'s; return the medians (seconds)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(2)
    built = {mode: build(mode, device) for mode in modes}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0)).to(device)
    step, it = interleaved(built, tokens, args.rounds)
    width = max(map(len, modes)) + 2
    print(f"AdamW on TinyLM, {device}, {args.rounds} rounds of 10 iterations, torch {torch.__version__}")
    print(f"{'mode':<{width}} {'step ms':>8} {'step / plain':>13} {'iteration ms':>13} {'iteration / plain':>18}")
    for mode in modes:
        print(f"{mode:<{width}} {1e3 * step[mode]:>8.2f} {step[mode] / step['plain']:>13.3f} "
              f"{1e3 * it[mode]:>13.2f} {it[mode] / it['plain']:>18.3f}")
    return step, it


def _sync(t):
    if t.is_cuda:
        torch.cuda.synchronize()


def extra_peak_fraction(cls, kwargs, device, modes):
    """Extra peak bytes of a logging step over the plain step, as a fraction of parameter bytes."""
    peaks = {}
    for mode in ("plain", *modes):
        model, opt = build(mode, cls, kwargs, device)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device)
        for _ in range(2):  # state exists (and graphs are compiled) before the measured step
            iteration(model, opt, tokens, {"step": [], "iter": []})
        model(tokens[:, :-1]).sum().backward()
        peaks[mode] = allocated_peak(opt.step)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {m: (peaks[m] - peaks["plain"]) / param_bytes for m in modes}


TARGETS = {("fused every=1", "step"): 2.0, ("fused every=1", "iter"): 1.05, ("fused every=10", "step"): 1.06,
           ("eager every=1", "step"): 4.0}
"""The issue's targets: ratio to the plain optimizer that a mode must not exceed."""
CLONE_TARGET = 0.6
"""fused every=1's step time as a fraction of clone-diff's, at most."""
MANY_TARGET = 2.0
"""A fused logging step on 2,000 small tensors, as a multiple of the plain step, at most."""
MEMORY_TARGET = 0.10
NOISE = 0.98
"""A ratio below this for a mode that does more than plain is impossible: the machine's load made it."""
MODES = ["plain", "floor", "fused kernels", "eager kernels", "clone-diff", "eager every=1", "fused every=1",
         "fused every=10"]


def verdict(value, target, noise=False, bound=None):
    """``met`` / ``NOT met``, ``impossible here`` where ``bound`` (the least the mode can cost, as a
    ``(value, what)`` pair) is above the target, or ``noise`` where the machine's load made the
    measurement impossible (also a value below its own bound: the mode does all of that work)."""
    if bound is not None and value < bound[0] and value <= target:
        return f"noise (below {bound[1]} alone, {bound[0]:.3f}: rerun when idle)"
    if noise:
        return "noise (rerun when idle)"
    if value <= target:
        return "met"
    if bound is not None and bound[0] > target:
        return f"impossible here ({bound[1]} alone {bound[0]:.3f})"
    return "NOT met"


def judged(ratio, mode, kind, step_share):
    """The ratio a target of ``mode`` is judged on: the step's as measured; for the iteration the larger
    of the measured one and the one its step time gives, ``1 + (step ratio - 1) * step_share``
    (``step_share``: the plain step's share of the plain iteration). The forward and backward passes
    are the same work in every mode, so an iteration below that was only hidden by drift of the
    machine between the modes' timings (one run measured SGD's at 1.047 where its step time gives
    1.074); the steps' medians vary far less than the iterations' differences."""
    if kind == "step":
        return ratio[mode]["step"]
    return max(ratio[mode]["iter"], 1 + (ratio[mode]["step"] - 1) * step_share)


def bounds(ratio, step_share):
    """The least each target's mode can cost: the fused modes at least the fused capture's tensor work
    (``fused kernels``; at every=10 one step in ten), the eager mode the eager capture's (``eager
    kernels``), every mode at least the ``floor``; a fused every=1 iteration at least the plain
    iteration plus that tensor work's extra step time (the forward and backward passes are the same
    in every mode), from the steps' medians, which vary far less than the iterations' differences:
    ``1 + (kernels step ratio - 1) * step_share``, ``step_share`` the plain step's share of the plain
    iteration. Keyed as :data:`TARGETS`, ``(ratio, what)``."""
    kernels, floor = ratio["fused kernels"]["step"], ratio["floor"]["step"]
    fused_step = max((kernels, "fused kernels"), (floor, "floor"))
    return {("fused every=1", "step"): fused_step,
            ("fused every=1", "iter"): (1 + (fused_step[0] - 1) * step_share, f"{fused_step[1]}' step time"),
            ("fused every=10", "step"): (1 + (fused_step[0] - 1) / 10, fused_step[1]),
            ("eager every=1", "step"): max((ratio["eager kernels"]["step"], "eager kernels"), (floor, "floor"))}


def bench(name, cls, kwargs, rounds, device):
    runs = {m: build(m, cls, kwargs, device) for m in MODES}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device)
    start = time.perf_counter()
    iteration(*runs["fused every=1"], tokens, {"step": [], "iter": []})
    compile_s = time.perf_counter() - start
    for _ in range(3):  # warm-up (every=10's first logging step included)
        for m in MODES:
            for _ in range(10 if m == "fused every=10" else 1):
                iteration(*runs[m], tokens, {"step": [], "iter": []})
    rounds_of = {m: {"step": [], "iter": []} for m in MODES}
    for _ in range(rounds):
        for m in MODES:
            timings = {"step": [], "iter": []}
            for _ in range(10):  # ten steps per round: every=10 logs exactly once per round
                iteration(*runs[m], tokens, timings)
            for k, v in timings.items():
                rounds_of[m][k].append(statistics.mean(v))
    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in rounds_of.items()}
    ratio = {m: {k: med[m][k] / med["plain"][k] for k in ("step", "iter")} for m in MODES}
    memory = extra_peak_fraction(cls, kwargs, device, ("floor", "fused kernels", "clone-diff", "eager every=1",
                                                        "fused every=1"))
    tensors = sum(1 for _ in runs["plain"][0].parameters())
    print(f"\n{name}: {tensors} parameter tensors, plain step {med['plain']['step'] * 1e3:.2f} ms, "
          f"iteration {med['plain']['iter'] * 1e3:.2f} ms; first fused logging step {compile_s:.1f} s (compile)")
    print(f"{'mode':<15} {'step / plain':>13} {'iteration / plain':>18} {'extra peak memory':>18}")
    for m in MODES:
        # plain: nothing extra
        mem = f"{memory[m]:.1%}" if m in memory else ("as fused every=1" if m == "fused every=10" else "0")
        print(f"{m:<15} {ratio[m]['step']:>13.3f} {ratio[m]['iter']:>18.3f} {mem:>18}")
    loaded = ratio["floor"]["step"] < NOISE  # the floor does more than plain: it cannot be faster
    share = med["plain"]["step"] / med["plain"]["iter"]
    least = bounds(ratio, share)
    noise = {(m, k): ratio[m][k] < NOISE or loaded for m, k in TARGETS}
    value = {(m, k): judged(ratio, m, k, share) for m, k in TARGETS}
    derived = {key: f" ({v:.3f} from its step time)" if v != ratio[key[0]][key[1]] else "" for key, v in value.items()}
    checks = [f"{m} {k} {ratio[m][k]:.3f}{derived[m, k]} <= {t} "
              f"{verdict(value[m, k], t, noise[m, k], least.get((m, k)))}" for (m, k), t in TARGETS.items()]
    vs_clone = med["fused every=1"]["step"] / med["clone-diff"]["step"]
    kernels_vs_clone = (least["fused every=1", "step"][0] / ratio["clone-diff"]["step"],
                        least["fused every=1", "step"][1])
    checks.append(f"fused every=1 / clone-diff {vs_clone:.2f} <= {CLONE_TARGET} "
                  f"{verdict(vs_clone, CLONE_TARGET, bound=kernels_vs_clone)}")
    checks.append(f"memory {memory['fused every=1']:.1%} <= {MEMORY_TARGET:.0%} "
                  f"{verdict(memory['fused every=1'], MEMORY_TARGET)}")
    print("targets: " + "; ".join(checks))
    print(f"above the floor: fused every=1 step {ratio['fused every=1']['step'] / ratio['floor']['step']:.2f}x "
          f"the floor's, eager every=1 {ratio['eager every=1']['step'] / ratio['floor']['step']:.2f}x; "
          f"above their tensor work: "
          f"fused every=1 {ratio['fused every=1']['step'] - ratio['fused kernels']['step']:.2f}, "
          f"eager every=1 {ratio['eager every=1']['step'] - ratio['eager kernels']['step']:.2f} of a plain step")
    if loaded:
        print("WARNING: a mode that does more than plain came out faster than it: other load on this machine "
              "skewed the timings; rerun when it is idle (or with more --rounds)")


class ManySmall(nn.Module):
    """2,000 small tensors: 1,000 Linear(8, 8) layers applied in turn (weights and biases)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(1000))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def bench_many(cls, kwargs, rounds, device):
    """One logging step on 2,000 small tensors against the plain step (step time only), with the fused
    capture's tensor work alone (``fused kernels``: here its flat chunks' copies, flattens and sums)
    as the least it can cost."""
    modes = ["plain", "fused kernels", "eager every=1", "fused every=1"]
    runs = {m: build(m, cls, kwargs, device, ManySmall) for m in modes}
    x = torch.randn(4, 8, device=device)
    for model, _ in runs.values():
        model(x).sum().backward()
    start = time.perf_counter()
    runs["fused every=1"][1].step()
    compile_s = time.perf_counter() - start
    times = {m: [] for m in modes}
    with warnings.catch_warnings():  # the chain of 1,000 tanh layers leaves most grads too small to move
        warnings.filterwarnings("ignore", "monitored_optim: parameter .* has not changed", RuntimeWarning)
        for _ in range(3 * rounds):
            for m in modes:
                opt = runs[m][1]
                _sync(x)
                t0 = time.perf_counter()
                opt.step()
                _sync(x)
                times[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    ratios = {m: med[m] / med["plain"] for m in modes[1:]}
    print(f"\n2,000 small tensors ({cls.__name__}): plain step {med['plain'] * 1e3:.2f} ms; logging step / plain: "
          + ", ".join(f"{m} {r:.2f}" for m, r in ratios.items()) + f" (first fused step {compile_s:.1f} s)")
    fused_step = ratios["fused every=1"]
    print(f"targets: fused logging step {fused_step:.2f} <= {MANY_TARGET} "
          f"{verdict(fused_step, MANY_TARGET, fused_step < NOISE, (ratios['fused kernels'], 'fused kernels'))}; "
          f"above its tensor work: {fused_step - ratios['fused kernels']:.2f} of a plain step "
          f"({(med['fused every=1'] - med['fused kernels']) / 2000 * 1e6:.1f} us of Python per parameter)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="3 rounds, for a first look")
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(max(1, torch.get_num_threads()))
    choices = {"adamw": (torch.optim.AdamW, dict(lr=1e-3)),
               "sgd": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9))}
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, {rounds} rounds")
    start = time.perf_counter()
    for name in args.optimizers.split(","):
        cls, kwargs = choices[name]
        bench(name, cls, kwargs, rounds, args.device)
    for name in args.optimizers.split(","):
        bench_many(*choices[name], rounds, args.device)
    print(f"\nbenchmark time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

"""The diagnostic families, each against a value computed here: per-layer spikes, optimizer-state
health, spectral update size; the user's own sinks; describe()."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from monitored_optim import Monitored, MonitorConfig

O = torch.optim


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def batches(steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=gen)
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen)
        yield x, torch.tanh(x @ w)


def spike_run(model, opt, steps, change_grads=lambda step: None, sched=None):
    """``health/spikes`` after each of ``steps`` steps on :func:`batches` (``change_grads(step)`` runs
    between backward and step), and the messages of the spike warnings."""
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(batches(steps), start=1):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            change_grads(step)
            opt.step()
            if sched is not None:
                sched.step()
            counts.append(opt.monitor.latest.get("health/spikes"))
    return counts, [str(w.message) for w in caught if "spike" in str(w.message)]


@pytest.mark.parametrize("cls,kwargs,figures", [
    (O.AdamW, dict(lr=1e-3), "(grad_norm)"),  # Adam's update keeps its size: only the grad spikes
    (O.SGD, dict(lr=1e-2), "(grad_norm and update_rms_per_lr)"),  # SGD's update follows the grad
], ids=["adamw", "sgd"])
def test_a_spike_injected_into_one_layer_is_named_and_only_it(tmp_path, cls, kwargs, figures):
    model = mlp()
    opt = Monitored(cls)(model.named_parameters(), **kwargs, monitor=MonitorConfig(backend="none", logdir=tmp_path))

    def spike(step):
        if step == 20:
            model[2].weight.grad *= 1e3  # a spike in 2.weight's gradient, nowhere else

    counts, spikes = spike_run(model, opt, 30, spike)
    assert spikes == [spikes[0]] and f"spike at step 20 in '2.weight' {figures}:" in spikes[0], spikes
    assert counts[19] == 1 and sum(counts) == 1, counts


def test_a_steady_update_whose_spread_moves_is_no_spike():
    """A 30-layer stack of Linear(4, 4) under Adam, logged every step: a four-element bias's update
    keeps its size (norm 0.0033 to 0.0037) while its grad grows smoothly and the centred spread of
    its update, update_to_data, rises by two decades; a change of spread is no spike."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)])
    opt = Monitored(O.Adam)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(backend="none", every=1))
    ratios, norms = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 151):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            ratios.append(opt.monitor.latest["update_to_data/7.bias"])
            norms.append(opt.monitor.latest["update_norm/7.bias"])
            assert opt.monitor.latest["health/spikes"] == 0, step
    assert max(ratios[60:80]) - min(ratios[60:80]) > 1.5  # the spread moved, as in the issue
    assert 0.003 < min(norms[60:80]) and max(norms[60:80]) < 0.004  # the size did not
    assert not [str(w.message) for w in caught if "spike" in str(w.message)]


@pytest.mark.parametrize("schedule", ["x0.05 at step 100", "x100 after a constant warmup", "grads x1e-3 at step 100"])
def test_a_learning_rate_change_or_a_fall_is_no_spike(schedule):
    """Logged every 10 steps: an lr cut (StepLR), the jump at the end of a constant warmup and a
    step whose grads fall a thousandfold move every layer's figures by 1.3 to 3 decades at once;
    judged per unit of lr, and only upwards, none of them is a spike."""
    model = mlp()
    opt = Monitored(O.AdamW)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(backend="none", every=10))
    factor = {"x0.05 at step 100": lambda k: 0.05 if k >= 99 else 1.0,
              "x100 after a constant warmup": lambda k: 1.0 if k >= 99 else 0.01}.get(schedule, lambda k: 1.0)

    def fall(step):
        if schedule.startswith("grads") and step == 100:
            for p in model.parameters():
                p.grad *= 1e-3

    counts, spikes = spike_run(model, opt, 150, fall, torch.optim.lr_scheduler.LambdaLR(opt, factor))
    assert counts[-1] is not None and not any(counts[9::10]), counts[9::10]
    assert not spikes, spikes


def train(cls, kwargs, steps, figures="all", model=None):
    model = model or mlp()
    opt = Monitored(cls)(model.named_parameters(), **kwargs, monitor=MonitorConfig(backend="none", figures=figures))
    record = []
    for x, y in batches(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        record.append(({n: p.detach() - before[n] for n, p in model.named_parameters()}, dict(opt.monitor.latest)))
    return model, opt, record


@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_figures_equal_the_state_computed_here(amsgrad):
    model, opt, record = train(O.AdamW, dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, amsgrad=amsgrad), 5)
    updates, latest = record[-1]
    for name, p in model.named_parameters():
        state = opt.state[p]
        v = state["max_exp_avg_sq" if amsgrad else "exp_avg_sq"].double()
        bias = 1 - 0.95 ** state["step"].item()
        assert latest[f"eps_dominated/{name}"] == pytest.approx(((v / bias).sqrt() < 1e-5).double().mean().item())
        for key in ("exp_avg", "exp_avg_sq"):
            assert latest[f"state_norm/{key}/{name}"] == pytest.approx(state[key].double().norm().item(), rel=1e-6)
        rms = updates[name].double().square().mean().sqrt().item()
        assert latest[f"normalized_update_rms/{name}"] == pytest.approx(rms / 1e-3, rel=1e-4)
    assert latest["health/zero_grad"] == 0


def test_a_dead_layer_counts_as_zero_grad_although_momentum_moves_it():
    model = mlp()
    opt = Monitored(O.SGD)(model.named_parameters(), lr=0.1, momentum=0.9, monitor=MonitorConfig(
        backend="none", figures="all"))
    for step, (x, y) in enumerate(batches(4), start=1):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step > 2:
            model[0].weight.grad.zero_()  # dead from step 3 on; its momentum still moves it
        opt.step()
    latest = opt.monitor.latest
    assert latest["health/zero_grad"] == 1 and latest["health/unchanged"] == 0
    assert latest["state_norm/momentum_buffer/0.weight"] > 0


@pytest.mark.parametrize("cls,kwargs,shape", [
    (O.SGD, dict(lr=0.05, momentum=0.9), (32, 32)),
    (O.AdamW, dict(lr=1e-3), (32, 32)),
    (O.Muon, dict(lr=0.02), (32, 32)),
    (O.AdamW, dict(lr=1e-3), (1024, 512)),  # reduced a block of rows at a time: one iteration a step
], ids=["sgd", "adamw", "muon", "adamw-large"])
def test_spectral_size_is_within_one_percent_of_the_matrix_norm(cls, kwargs, shape):
    torch.manual_seed(0)
    w = nn.Parameter(0.02 * torch.randn(shape))
    opt = Monitored(cls)([("w", w)], **kwargs, monitor=MonitorConfig(backend="none", figures="all"))
    gen = torch.Generator().manual_seed(1)
    left, right = torch.randn(shape[0], 3, generator=gen), torch.randn(3, shape[1], generator=gen)
    errors = []
    for step in range(12):
        w.grad = left @ right + 0.1 * torch.randn(shape, generator=gen)  # a gradient with a dominant direction
        before = w.detach().clone()
        opt.step()
        u = (w.detach() - before).double()
        sigma = torch.linalg.matrix_norm(u, 2).item()
        latest = opt.monitor.latest
        want = sigma * math.sqrt(shape[1] / shape[0])
        errors.append(abs(latest["update_spectral/w"] - want) / want)
        if step >= 4:  # after a few logging steps
            assert latest["update_stable_rank/w"] == pytest.approx(u.square().sum().item() / sigma**2, rel=0.03)
    assert max(errors[4:]) < 0.01, errors


def test_families_are_off_by_default_and_on_with_all():
    _, _, record = train(O.AdamW, dict(lr=1e-3), 2, figures=None)
    tags = set(record[-1][1])
    assert "health/spikes" in tags
    assert not {t for t in tags if t.split("/")[0] in ("state_norm", "eps_dominated", "update_spectral")}


def test_own_sinks_get_every_figure_and_a_failing_one_is_dropped(tmp_path):
    got = []

    class EarlyStop:
        closed = False

        def log(self, metrics, step):
            got.append((step, metrics["global/update_norm"]))

        def close(self):
            EarlyStop.closed = True

    def broken(metrics, step):
        raise RuntimeError("alert service down")

    seen = []
    model = mlp()
    opt = Monitored(O.SGD)(model.named_parameters(), lr=0.1, monitor=MonitorConfig(
        backend=["jsonl", EarlyStop(), lambda m, s: seen.append(s), broken], logdir=tmp_path))
    with pytest.warns(RuntimeWarning, match=r"your sink 2 \(broken\) failed .*alert service down"):
        for x, y in batches(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    opt.monitor.close()
    assert [s for s, _ in got] == seen == [1, 2, 3] and EarlyStop.closed
    assert got[-1][1] == opt.monitor.latest["global/update_norm"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_describe_says_how_each_parameter_is_captured():
    m = nn.ModuleDict({"emb": nn.Embedding(1000, 300), "ln": nn.LayerNorm(300), "fc": nn.Linear(300, 300)})
    m["low"] = nn.Linear(4, 4).to(torch.bfloat16)
    opt = Monitored(O.AdamW)([{"params": list(m.named_parameters()), "weight_decay": 0.1}], lr=3e-4,
                              monitor=MonitorConfig(backend="none", exclude="fc.bias"))
    text = opt.monitor.describe()
    names = dict(m.named_parameters())
    rows = {line.split()[0]: line for line in text.splitlines() if line and line.split()[0] in names}
    assert "lr=0.0003" in text and "weight_decay=0.1" in text
    assert rows["emb.weight"].split()[1:4] == ["1000x300", "float32", "matrix"]
    from monitored_optim.capture.change import budget

    limit = budget(sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n != "fc.bias")) // 4
    assert rows["emb.weight"].endswith(f"view (AdamView), in {-(-1000 * 300 // limit)} slices")
    assert rows["fc.weight"].endswith(f"view (AdamView), in {-(-300 * 300 // limit)} slices")
    assert rows["fc.bias"].endswith("skipped (left out by the selection: params=, exclude= or MONITORED_OPTIM_PARAMS)")
    assert rows["ln.weight"].endswith("copied flat (at most 4,096 elements)")  # 300 elements
    assert rows["low.weight"].endswith("snapshot (low precision)")
    lbfgs = Monitored(O.LBFGS)(list(m["fc"].named_parameters()), monitor=MonitorConfig(backend="none"))
    assert "clone (no state-aware view" in lbfgs.monitor.describe()


def _table_of(names, figures):
    """A moment table whose grad norms and update RMSs are ``figures``' (two elements of mean 0 per
    parameter, p's std 1; a missing grad norm a zero one)."""
    from monitored_optim.hosted import MomentTable

    m2 = torch.tensor([[1.0, figures.get(f"grad_norm/{name}", 0.0) ** 2, 2 * figures[f"update_rms/{name}"] ** 2]
                       for name in names], dtype=torch.float64)
    n = torch.full((len(names), 1), 2.0, dtype=torch.float64)
    return MomentTable(n, torch.zeros_like(m2), m2, torch.zeros_like(m2, dtype=torch.bool))


def test_spike_counts_equal_hampels_identifier_computed_here():
    """The vectorized spikes family against the one-sided rule written out with ``statistics.median``
    per series, over 60 logging steps of 30 parameters with injected jumps up and falls, missing
    values, zero norms and a decaying lr (known for half the parameters)."""
    import math
    import statistics
    from collections import deque
    from types import SimpleNamespace

    from monitored_optim.families import spikes as S

    gen = torch.Generator().manual_seed(0)
    names = [f"layers.{i}.weight" for i in range(30)]
    family, history, total = S.Spikes(), {}, 0
    for step in range(1, 61):
        lr = 1e-3 * 0.9 ** step  # 0.05 decades per step: 2.7 over the run
        lrs = [lr if i % 2 else None for i in range(len(names))]
        figures = {}
        for i, name in enumerate(names):
            g = float(10 ** (torch.randn(1, generator=gen).item() * 0.1 - 2))
            r = -3 + math.log10(lr / 1e-3) + 0.05 * torch.randn(1, generator=gen).item()  # log10 RMS of u ∝ lr
            near = 0.9 + 0.2 * torch.rand(1, generator=gen).item()  # about the floor of a factor of 10:
            if (step + i) % 7 == 0:  # jumps on both sides of the rule's bound
                g *= 10 ** near
            if (step + i) % 11 == 0:  # falls, never spikes
                g /= 10 ** (2 * near)
            if (step * i) % 5 == 1:
                r += near if (step + i) % 2 else -2 * near
            if (step + 2 * i) % 13 != 0:  # sometimes missing
                figures[f"grad_norm/{name}"] = 0.0 if (step + i) % 29 == 0 else g
            figures[f"update_rms/{name}"] = 0.0 if (step + i) % 23 == 0 else 10 ** r  # sometimes no update
        want = 0
        for name, group_lr in zip(names, lrs):
            hit = False
            for kind in ("grad_norm", "update_rms"):
                value = figures.get(f"{kind}/{name}")
                if value is None or value <= 0:
                    continue
                x = math.log10(value) - (math.log10(group_lr or 1.0) if kind == "update_rms" else 0.0)
                past = history.setdefault((name, kind), deque(maxlen=S.WINDOW))
                spike = False
                if len(past) >= S.MIN_HISTORY:
                    m = statistics.median(past)
                    mad = statistics.median(abs(v - m) for v in past)
                    spike = x - m > max(S.THRESHOLD * 1.4826 * mad, S.FLOOR)
                if not spike:
                    past.append(x)
                hit |= spike
            want += hit
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its one warning is tested above
            got = family.figures(SimpleNamespace(step=step, names=names, table=_table_of(names, figures), lrs=lrs))
        assert got["health/spikes"] == want, (step, got, want)
        total += want
    assert total > 30, total  # the bound was crossed often enough to tell rules apart


@pytest.mark.parametrize("blow_up", ["inf in a grad", "nan in a grad", "huge finite update"])
def test_a_non_finite_or_overflowing_update_leaves_the_spectral_figure_out(blow_up):
    """``figures="all"``: a blown-up update gives no ``update_spectral`` for that matrix (instead of
    a failed eigensolver stopping training), health counts it, and the next steps go on."""
    torch.manual_seed(0)
    dtype = torch.float64 if blow_up == "huge finite update" else torch.float32  # float64: its squares overflow
    model = nn.Linear(32, 32).to(dtype)
    opt = Monitored(O.SGD)(model.named_parameters(), lr=1e-2, monitor=MonitorConfig(backend="none", figures="all"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the non-finite warning is tested in test_health
        for step in range(1, 4):
            opt.zero_grad()
            model(torch.randn(4, 32, dtype=dtype)).sum().backward()
            if step == 2:
                model.weight.grad[0, 0] = {"inf in a grad": math.inf, "nan in a grad": math.nan,
                                           "huge finite update": 1e300}[blow_up]
            opt.step()
            latest = opt.monitor.latest
            if step == 1:
                assert latest["update_spectral/weight"] > 0
            if step == 2:
                assert "update_spectral/weight" not in latest
                assert latest["health/nonfinite"] >= 1 or blow_up == "huge finite update"

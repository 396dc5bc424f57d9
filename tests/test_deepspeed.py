"""DeepSpeed ZeRO 0-3 on CPU/gloo, 2 processes: the figures of the model's own parameters, under their
names, equal the truth from the full fp32 parameters gathered before and after each step
(``deepspeed.utils.safe_get_full_fp32_param``), their histograms numpy's of those full tensors, one logged row per
engine step, one collective more
per logging step (two more for the names' exchange at the first), the trajectory bit for bit the
plain optimizer's.

The model is a small MLP whose LayerNorm weight starts at 1.0 and whose biases start at 0, in two
param groups (decay / no decay) or one; each rank trains on its half of each batch.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from monitored_optim import Monitored, MonitorConfig
from test_distributed import CountCollectives, launch
from test_histograms import assert_all_exact, spacing

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed first asks for its accelerator
deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install '.[deepspeed]')")

STEPS, EVERY, BATCH = 4, 1, 8
"""Every step logs: the first one too, which the monitor meets inside DeepSpeed's step at stages 1-3."""
OPT = dict(lr=1e-2, weight_decay=0.1)
RATIO_TOL, NORM_RTOL = 2e-3, 1e-4
"""DESIGN.md invariant 4's fp32 tolerances: the optimizer steps fp32 master weights at every stage."""
DEADLINE = 600.0
"""DeepSpeed builds one small op with ninja and g++ the first time (about 40 s), then caches it."""
CASES = [("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)]
"""(precision, param groups) run at each stage."""


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 48), nn.LayerNorm(48), nn.Linear(48, 40), nn.Linear(40, 5))
    for module in net:
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
    return net


def groups(net: nn.Module, count: int) -> list[dict] | object:
    """The model's parameters, named: one group, or decay (matrices) and no decay (the rest)."""
    named = list(net.named_parameters())
    if count == 1:
        return named
    return [{"params": [p for _, p in named if p.ndim >= 2], "param_names": [n for n, p in named if p.ndim >= 2]},
            {"params": [p for _, p in named if p.ndim < 2], "param_names": [n for n, p in named if p.ndim < 2],
             "weight_decay": 0.0}]


def full(net: nn.Module, stage: int, wrapper, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 value (or grad), as DeepSpeed gathers it."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    out = {}
    copies = {}
    if stage == 0 and hasattr(wrapper, "fp32_groups"):  # bf16 at stage 0: an fp32 copy of each parameter
        copies = {id(lp): hp for lps, hps in zip(wrapper.fp16_groups, wrapper.fp32_groups) for lp, hp in zip(lps, hps)}
    for name, p in net.named_parameters():
        if grads:
            g = safe_get_full_grad(p)
            out[name] = None if g is None else g.detach().float().clone()
        elif id(p) in copies:
            out[name] = copies[id(p)].detach().clone()
        else:
            got = safe_get_full_fp32_param(p) if stage else None
            out[name] = (got if got is not None else p.detach()).float().clone()
    return out


def truth(before: dict, after: dict, grads: dict) -> dict[str, float]:
    """The figures from full tensors: per parameter and global."""
    out, sq = {}, {"update": 0.0, "grad": 0.0, "param": 0.0}
    for name, p in before.items():
        u = (after[name] - p).double()
        p64, g = p.double(), grads[name].double()
        out[f"update_norm/{name}"], out[f"param_norm/{name}"] = u.norm().item(), p64.norm().item()
        out[f"grad_norm/{name}"] = g.norm().item()
        for tag, top in (("update_to_data", u), ("grad_to_data", g)):
            if top.std() > 0 and p64.std() > 0:  # else undefined, and not sent (a bias at 0, a LayerNorm at 1.0)
                out[f"{tag}/{name}"] = math.log10(top.std().item() / p64.std().item())
        for kind, t in (("update", u), ("grad", g), ("param", p64)):
            sq[kind] += t.square().sum().item()
    out.update({f"global/{kind}_norm": math.sqrt(v) for kind, v in sq.items()})
    return out


def histogram_truth(before: dict, after: dict, grads: dict) -> dict[str, list[int]]:
    """numpy's histograms of the full tensors over the declared edges: u, the grad, p after."""
    from test_distributed import histogram_of

    out = {}
    for name, p in before.items():
        out[f"update_hist/{name}"] = histogram_of(after[name].double() - p.double())
        out[f"grad_hist/{name}"] = histogram_of(grads[name])
        out[f"param_hist/{name}"] = histogram_of(after[name])
    return out


def _train(rank, world, outdir, stage, precision, count, monitored, direct_first=False):
    os.environ["DS_ACCELERATOR"] = "cpu"
    net = model()
    cls = Monitored(torch.optim.AdamW) if monitored else torch.optim.AdamW
    extra = {"monitor": MonitorConfig(backend="jsonl", every=EVERY, logdir=os.path.join(outdir, "logs"),
                                      figures="default,histograms")} if monitored else {}
    opt = cls(groups(net, count), **OPT, **extra)
    zero = {"stage": stage, **({"sub_group_size": 600} if precision == "fp32, sub-groups" else {})}
    config = {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_clipping": 0,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": precision == "bf16"}}
    if direct_first:  # a step of the user's before DeepSpeed's wrapper ever calls one (no grads: no change)
        opt.step()
    engine, wrapper, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    if precision == "fp32, sub-groups":
        assert len(wrapper.fp16_groups) > 2  # more sub-groups than param groups
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rows, hists, counts = {}, {}, []
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 5, generator=g)
        half = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        loss = (engine(x[half].to(dtype)).float() - y[half]).square().mean()
        engine.backward(loss)
        logs = monitored and step % EVERY == 0
        if logs:
            before, grads = full(net, stage, wrapper), full(net, stage, wrapper, grads=True)
        with CountCollectives() as c:
            engine.step()
        counts.append(c.ops)
        if logs:
            after = full(net, stage, wrapper)
            rows[step] = (truth(before, after, grads), dict(opt.monitor.latest))
            hists[step] = (histogram_truth(before, after, grads), dict(opt.monitor.histograms))
    final = full(net, stage, wrapper)
    return {"rows": rows, "hists": hists, "counts": counts, "final": final,
            "step": opt.monitor.step if monitored else None}


def _stage(rank, world, outdir, stage):
    out = {}
    for precision, count in CASES + ([("fp32, sub-groups", 2)] if stage == 3 else []):  # 600-element sub-groups
        for monitored in (True, False):
            sub = os.path.join(outdir, f"{precision}-{count}-{monitored}")
            os.makedirs(sub, exist_ok=True)
            import warnings

            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                result = _train(rank, world, sub, stage, precision, count, monitored)
            result["warnings"] = [str(w.message) for w in seen if "monitored_optim" in str(w.message)]
            out[precision, count, monitored] = result
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_zero_figures_equal_the_gathered_truth(stage, tmp_path):
    results = launch(lambda r, w, o: _stage(r, w, o, stage), 2, tmp_path, deadline=DEADLINE)
    for (precision, count, monitored), res in results[0].items():
        case = (stage, precision, count)
        if not monitored:
            continue
        plain = results[0][precision, count, False]
        for name, value in plain["final"].items():  # the trajectory: the plain optimizer's, bit for bit
            assert torch.equal(res["final"][name], value), (case, name)
        assert res["step"] == STEPS, case
        assert sorted(res["rows"]) == [s for s in range(1, STEPS + 1) if s % EVERY == 0], case
        for step, (want, got) in res["rows"].items():
            for tag, value in want.items():
                assert tag in got, (case, step, tag, sorted(got))
                if "_to_data/" in tag:
                    assert abs(got[tag] - value) <= RATIO_TOL, (case, step, tag, got[tag], value)
                else:
                    assert abs(got[tag] - value) <= NORM_RTOL * abs(value) + 1e-30, (case, step, tag, got[tag], value)
            assert {f"lr/group{i}" for i in range(count)} <= set(got), (case, step)  # the first step's too
            per_param = {t.split("/", 1)[1] for t in got if t.startswith("param_norm/")}
            assert per_param == {t.split("/", 1)[1] for t in want if t.startswith("param_norm/")}, case
            assert got["health/nonfinite"] == 0, case
        for step, (want, got) in res["hists"].items():  # whole parameters' counts, summed over fragments and ranks
            assert got == want, (case, step, [t for t in want if got.get(t) != want[t]])
            # their extremes, over the fragments of the ranks; an update's within a spacing of its parameter
            assert_all_exact(got, want, {f"update_hist/{n}": spacing(p) for n, p in res["final"].items()})
        assert all(r["rows"] == res["rows"] and r["hists"] == res["hists"]
                   for r in [results[1][precision, count, True]]), case
        plain_ops = [len(ops) for ops in plain["counts"]]
        for step, ops in enumerate(res["counts"], start=1):
            more = (step % EVERY == 0) * (1 + 2 * (step == EVERY))  # the table; the names, at the first
            assert len(ops) == plain_ops[step - 1] + more, (case, step, ops, plain["counts"][step - 1])
        assert res["warnings"] == [], (case, res["warnings"])
        logs = tmp_path / f"{precision}-{count}-True" / "logs"
        lines = (logs / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == sorted(res["rows"]), case
        shapes = {name: v["shape"] for name, v in json.loads((logs / "params.json").read_text()).items()}
        assert shapes == {name: list(p.shape) for name, p in model().named_parameters()}, case  # not a fragment's


def hf_args(output_dir: str, stage: int, config: dict | None = None, **kwargs):
    """TrainingArguments of a short HF run with ``deepspeed=`` at ZeRO ``stage`` (``config`` added to
    its DeepSpeed config), seeded, logging nowhere."""
    import transformers

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": stage}, **(config or {})}
    return transformers.TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, deepspeed=ds, save_strategy="no",
        report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, **kwargs)


def _hf(rank, world, outdir, stage):
    """The HF Trainer with ``deepspeed=``, the monitored class given as ``optimizer_cls_and_kwargs``,
    beside the same run with the plain class."""
    import warnings

    import transformers
    from accelerate.state import AcceleratorState, PartialState

    from test_integrations import Tokens, tiny_gpt2

    os.environ["DS_ACCELERATOR"] = "cpu"
    out = {}
    for monitored in (True, False):
        model = tiny_gpt2()
        args = hf_args(os.path.join(outdir, f"hf{monitored}"), stage)
        kwargs = {"lr": 1e-3}
        if monitored:
            kwargs["monitor"] = MonitorConfig(backend="jsonl", every=EVERY, logdir=os.path.join(outdir, "logs"),
                                              model=model)
        cls = Monitored(torch.optim.AdamW) if monitored else torch.optim.AdamW
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(16),
                                       optimizer_cls_and_kwargs=(cls, kwargs))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.train()
        engine = trainer.model_wrapped
        opt = engine.basic_optimizer
        out[monitored] = {"final": full(model, stage, engine.optimizer),
                          "names": [n for n, p in model.named_parameters() if p.requires_grad],
                          "step": opt.monitor.step if monitored else None,
                          "latest": dict(opt.monitor.latest) if monitored else None,
                          "warnings": [str(w.message) for w in seen if "monitored_optim" in str(w.message)]}
        AcceleratorState._reset_state(reset_partial_state=True)  # the next Trainer builds its own
        PartialState._reset_state()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hf_trainer_deepspeed_monitors_the_model_by_name(stage, tmp_path):
    results = launch(lambda r, w, o: _hf(r, w, o, stage), 2, tmp_path, deadline=DEADLINE)
    got, plain = results[0][True], results[0][False]
    for name, value in plain["final"].items():
        assert torch.equal(got["final"][name], value), name
    assert got["step"] == STEPS and got["warnings"] == []
    assert {t.split("/", 1)[1] for t in got["latest"] if t.startswith("update_to_data/")} == set(got["names"])
    assert results[1][True]["latest"] == got["latest"]
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(EVERY, STEPS + 1, EVERY))


def test_a_monitored_optimizer_the_trainer_replaced_says_so_at_exit(tmp_path):
    """``Trainer(optimizers=(Monitored(AdamW)(...), None), deepspeed=...)``: the Trainer trains with an
    AdamW of its own; the monitored one, never stepped, says so once when the process ends."""
    from test_distributed import _free_port

    child = Path(__file__).with_name("replaced_child.py")
    done = subprocess.run([sys.executable, str(child), str(_free_port()), str(tmp_path)], capture_output=True,
                          text=True, timeout=300, cwd=child.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["2", "AdamW"]  # trained 2 steps, with the Trainer's own optimizer
    told = [line for line in done.stderr.splitlines() if "monitored_optim" in line]
    assert len(told) == 1 and "1 monitored optimizer(s) (AdamW) were built but never stepped" in told[0], told


def test_digits_deepspeed_example_runs_under_torchrun(tmp_path):
    """examples/digits_deepspeed.py at stage 3 on 2 CPU processes: trains, rank 0 alone writes and prints,
    the figures under the model's names."""
    example = Path(__file__).resolve().parents[1] / "examples" / "digits_deepspeed.py"
    env = {**os.environ, "MONITORED_OPTIM_BACKEND": "jsonl", "MONITORED_OPTIM_LOGDIR": str(tmp_path / "logs"),
           "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(example), "--stage", "3", "--epochs", "2"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=example.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 2 * 23 + 1))  # conftest: every=1
    assert out.stdout.count("test accuracy") == 1 and "ZeRO stage 3 on 2 ranks, 46 optimizer steps" in out.stdout
    line = next(line for line in out.stdout.splitlines() if line.startswith("fc2.weight "))
    assert float(line.split()[1]) == round(rows[-1]["update_to_data/fc2.weight"], 2)


def test_a_direct_step_before_deepspeed_wraps_the_optimizer(tmp_path):
    """``opt.step()`` called once before ``deepspeed.initialize`` (no grads: nothing moves): DeepSpeed's
    wrapper is still found at its first step, and counted and named as without that call."""
    def run(rank, world, outdir):
        return _train(rank, world, outdir, 2, "fp32", 2, True, direct_first=True)

    res = launch(run, 2, tmp_path, deadline=DEADLINE)[0]
    assert res["step"] == STEPS + 1  # the direct call is a step of the optimizer's, then the engine's 4
    for want, got in res["rows"].values():
        assert {t for t in got if t.startswith("param_norm/")} == {t for t in want if t.startswith("param_norm/")}
        assert abs(got["global/update_norm"] - want["global/update_norm"]) <= NORM_RTOL * want["global/update_norm"]


def _attached(rank, world, outdir, stage, precision, monitored):
    """``attach(engine)`` after ``deepspeed.initialize`` with the optimizer DeepSpeed builds from its
    config's ``"optimizer"`` section; the same run without ``attach`` beside it."""
    from monitored_optim import attach

    os.environ["DS_ACCELERATOR"] = "cpu"
    net = model()
    config = {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_clipping": 0,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    engine, wrapper, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    if monitored:
        assert attach(engine, MonitorConfig(backend="jsonl", every=EVERY, logdir=os.path.join(outdir, "logs"))) \
            is engine
    opt = engine.basic_optimizer
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rows = {}
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 5, generator=g)
        half = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        engine.backward((engine(x[half].to(dtype)).float() - y[half]).square().mean())
        before, grads = full(net, stage, wrapper), full(net, stage, wrapper, grads=True)
        engine.step()
        if monitored:
            rows[step] = (truth(before, full(net, stage, wrapper), grads), dict(opt.monitor.latest))
    return {"rows": rows, "final": full(net, stage, wrapper), "class": type(opt).__mro__[int(monitored)].__name__,
            "step": opt.monitor.step if monitored else None}


@pytest.mark.parametrize("stage", [1, 3])
def test_attach_to_an_engine_monitors_the_optimizer_deepspeed_built(stage, tmp_path):
    def run(rank, world, outdir):
        import warnings

        out = {}
        for precision in ("fp32", "bf16"):
            for monitored in (True, False):
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    out[precision, monitored] = _attached(rank, world, os.path.join(outdir, precision), stage,
                                                          precision, monitored)
                out[precision, monitored]["warnings"] = [str(w.message) for w in seen
                                                         if "monitored_optim" in str(w.message)]
        return out

    results = launch(run, 2, tmp_path, deadline=DEADLINE)
    for precision in ("fp32", "bf16"):
        got, plain = results[0][precision, True], results[0][precision, False]
        assert got["class"] == plain["class"], precision  # DeepSpeed's own optimizer, monitored
        for name, value in plain["final"].items():
            assert torch.equal(got["final"][name], value), (precision, name)
        assert got["step"] == STEPS and got["warnings"] == [], (precision, got["warnings"])
        for step, (want, logged) in got["rows"].items():
            norms = {t for t in want if t.startswith("param_norm/")}
            assert {t for t in logged if t.startswith("param_norm/")} == norms
            for tag, value in want.items():
                if "_to_data/" in tag:
                    assert abs(logged[tag] - value) <= RATIO_TOL, (precision, step, tag, logged[tag], value)
                else:
                    assert abs(logged[tag] - value) <= NORM_RTOL * abs(value) + 1e-30, (precision, step, tag)
        assert results[1][precision, True]["rows"] == got["rows"]
        lines = (tmp_path / precision / "logs" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))


def _engine_as_model(rank, world, outdir):
    """The optimizer DeepSpeed builds from its config, attached with the engine given as ``model=``
    (whose ``named_parameters()`` say ``module.0.weight``), at stages 0 and 2: the names in the tags."""
    from monitored_optim import attach

    os.environ["DS_ACCELERATOR"] = "cpu"
    out = {}
    for stage in (0, 2):
        net = model()
        config = {"train_micro_batch_size_per_gpu": BATCH // world, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
        engine, wrapper, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
        assert next(iter(dict(engine.named_parameters()))).startswith("module.")
        attach(wrapper, MonitorConfig(backend="none", every=1, model=engine))
        x = torch.randn(BATCH // world, 16, generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(x).square().mean())
        engine.step()
        latest = engine.basic_optimizer.monitor.latest
        out[stage] = {t.split("/", 1)[1] for t in latest if t.startswith("param_norm/")}
    return out


def test_an_engine_given_as_model_gives_the_plain_model_s_names(tmp_path):
    """``MonitorConfig(model=engine)`` (as accelerate hands the engine on): the tags carry the model's
    own names, not the engine's ``module.``-prefixed ones, as ``attach(engine)`` and one process do."""
    plain = {n for n, _ in model().named_parameters()}
    results = launch(_engine_as_model, 2, tmp_path, deadline=DEADLINE)
    assert results[0] == results[1] == {0: plain, 2: plain}


def _hf_callback(rank, world, outdir, stage, built_by_deepspeed):
    """The HF Trainer with ``deepspeed=`` (a config with an ``"optimizer"`` section or none) and
    ``callbacks=[MonitorCallback()]``, beside the same run without the callback; the gathered truth
    of each step taken around the step of DeepSpeed's wrapper."""
    import warnings

    import transformers
    from accelerate.state import AcceleratorState, PartialState

    from monitored_optim.hf import MonitorCallback
    from test_integrations import Tokens, tiny_gpt2

    class Truth(transformers.TrainerCallback):
        rows: list = []

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            wrapper = optimizer.optimizer  # accelerate's wrapper holds DeepSpeed's
            step = wrapper.step

            def measured(*a, **k):
                before, grads = full(model, stage, wrapper), full(model, stage, wrapper, grads=True)
                out = step(*a, **k)
                self.rows.append(truth(before, full(model, stage, wrapper), grads))
                return out

            wrapper.step = measured

    os.environ["DS_ACCELERATOR"] = "cpu"
    out = {}
    for monitored in (True, False):
        model = tiny_gpt2()
        section = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
                   "zero_allow_untested_optimizer": True} if built_by_deepspeed else {}
        args = hf_args(os.path.join(outdir, f"hf{monitored}"), stage, section, learning_rate=1e-3, weight_decay=0.1,
                       max_grad_norm=0.0)  # the truth's grads: unclipped
        monitor = MonitorConfig(backend="jsonl", every=EVERY, logdir=os.path.join(outdir, "logs"))
        measure = Truth()
        measure.rows = []
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(16),
                                       callbacks=[MonitorCallback(monitor), measure] if monitored else [])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.train()
        opt = trainer.model_wrapped.basic_optimizer
        out[monitored] = {"final": full(model, stage, trainer.model_wrapped.optimizer),
                          "names": [n for n, p in model.named_parameters() if p.requires_grad],
                          "class": type(opt).__mro__[int(monitored)].__name__,
                          "step": opt.monitor.step if monitored else None,
                          "latest": dict(opt.monitor.latest) if monitored else None, "truth": measure.rows,
                          "warnings": [str(w.message) for w in seen if "monitored_optim" in str(w.message)]}
        AcceleratorState._reset_state(reset_partial_state=True)  # the next Trainer builds its own
        PartialState._reset_state()
    return out


@pytest.mark.parametrize("stage,built_by_deepspeed", [(2, True), (3, True), (3, False)])
def test_hf_trainer_deepspeed_callback_monitors_the_optimizer_it_steps(stage, built_by_deepspeed, tmp_path):
    results = launch(lambda r, w, o: _hf_callback(r, w, o, stage, built_by_deepspeed), 2, tmp_path,
                     deadline=DEADLINE)
    got, plain = results[0][True], results[0][False]
    assert got["class"] == plain["class"]
    for name, value in plain["final"].items():
        assert torch.equal(got["final"][name], value), name
    assert got["step"] == STEPS and got["warnings"] == [] and len(got["truth"]) == STEPS
    want = got["truth"][-1]
    assert {t for t in got["latest"] if t.startswith("param_norm/")} == {f"param_norm/{n}" for n in got["names"]}
    for tag, value in want.items():
        if "_to_data/" in tag:
            assert abs(got["latest"][tag] - value) <= RATIO_TOL, (tag, got["latest"][tag], value)
        else:
            assert abs(got["latest"][tag] - value) <= NORM_RTOL * abs(value) + 1e-30, (tag, got["latest"][tag], value)
    assert results[1][True]["latest"] == got["latest"]
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(EVERY, STEPS + 1, EVERY))


def _guarded(rank, world, outdir):
    """The guard refused under DeepSpeed's ZeRO wrapper: by ``attach(engine)`` at once, and by a monitored
    optimizer given to ``deepspeed.initialize`` at the first step, where the wrapper is found."""
    from monitored_optim import attach

    os.environ["DS_ACCELERATOR"] = "cpu"
    config = {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_clipping": 0,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    guard = MonitorConfig(backend="none", guard="nonfinite")
    told = []
    built = model()
    engine, *_ = deepspeed.initialize(model=built, model_parameters=built.parameters(),
                                      config={**config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    try:
        attach(engine, guard)
    except ValueError as err:
        told.append(str(err))
    inner = engine.optimizer.optimizer
    assert "_monitor" not in vars(inner) and not type(inner).__name__.startswith("Monitored")  # left as it was
    net = model()
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), lr=1e-2, monitor=guard)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    engine.backward(engine(torch.randn(BATCH // world, 16)).square().mean())
    try:
        engine.step()
    except ValueError as err:
        told.append(str(err))
    return told


def test_the_guard_under_a_deepspeed_engine_fails_with_deepspeeds_own_means(tmp_path):
    for told in launch(_guarded, 2, tmp_path, deadline=DEADLINE):
        assert len(told) == 2
        assert all("MonitorConfig.guard cannot skip a DeepSpeed engine's steps" in t and "loss scaling" in t
                   for t in told)

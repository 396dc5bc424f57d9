"""DeepSpeed's steps driving the monitor (:class:`monitored_optim.engine.EngineSteps`), in this process:
one rank of gloo, ZeRO 0-3 on the CPU. Each engine step is one monitored step, however many base steps
the wrapper takes in it (one per param group at stages 1-2, one per sub-group at stage 3); its logged
row equals the truth of the full fp32 parameters gathered before and after it; the trajectory is the
plain optimizer's, bit for bit. The 2-process runs are in ``test_deepspeed.py``.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from monitored_optim import Monitored, MonitorConfig, attach

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed first asks for its accelerator
deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install '.[deepspeed]')")

from test_deepspeed import BATCH, NORM_RTOL, OPT, RATIO_TOL, STEPS, full, groups, model, truth  # noqa: E402


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A process group of this process alone, as torchrun would describe it to DeepSpeed."""
    saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _run(tmp_path, stage: int, precision: str, monitored: bool, built: bool = False) -> dict:
    """STEPS engine steps of the test model at ``stage``: per step, the base steps the wrapper took, the
    monitor's count and latest figures, and the truth; ``built``: DeepSpeed builds the optimizer from
    its config and ``attach(engine)`` monitors it."""
    net = model()
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, **({"sub_group_size": 600} if stage == 3 else {})},
              "bf16": {"enabled": precision == "bf16"}}
    monitor = MonitorConfig(backend="jsonl", every=1, logdir=str(tmp_path / "logs"))
    if built:
        config["optimizer"] = {"type": "AdamW", "params": OPT}
        engine, wrapper, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
        opt = engine.basic_optimizer
        if monitored:
            attach(engine, monitor)
    else:
        opt = (Monitored(torch.optim.AdamW) if monitored else torch.optim.AdamW)(
            groups(net, 2), **OPT, **({"monitor": monitor} if monitored else {}))
        engine, wrapper, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    out: dict = {"calls": [], "steps": [], "rows": []}
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 5, generator=g)
        engine.backward((engine(x.to(dtype)).float() - y).square().mean())
        before, grads = full(net, stage, wrapper), full(net, stage, wrapper, grads=True)
        calls = opt.monitor._engine.base_calls if monitored else 0
        engine.step()
        if monitored:
            out["calls"].append(opt.monitor._engine.base_calls - calls)
            out["steps"].append(opt.monitor.step)
            out["rows"].append((truth(before, full(net, stage, wrapper), grads), dict(opt.monitor.latest)))
    out["final"] = full(net, stage, wrapper)
    out["described"] = opt.monitor.describe() if monitored else ""
    out["groups"] = len(getattr(wrapper, "fp16_groups", opt.param_groups))  # flat buffers (sub-groups at stage 3)
    return out


CASES = [(stage, precision, built) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16") for built in
         (False, True) if not (built and stage in (0, 2))]


@pytest.mark.parametrize("stage,precision,built", CASES)
def test_each_engine_step_is_one_monitored_step_with_the_truth(one_rank, stage, precision, built, tmp_path):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _run(tmp_path / "monitored", stage, precision, True, built)
        plain = _run(tmp_path / "plain", stage, precision, False, built)
    assert [str(w.message) for w in seen if "monitored_optim" in str(w.message)] == []
    for name, value in plain["final"].items():  # the trajectory: the plain optimizer's, bit for bit
        assert torch.equal(got["final"][name], value), name
    assert got["steps"] == list(range(1, STEPS + 1))  # one monitored step per engine step
    assert got["calls"] == [1 if stage == 0 else got["groups"]] * STEPS  # stages 1-3: a base step per flat buffer
    if stage == 3:
        assert got["groups"] > 2  # more sub-groups than param groups: still one logged step
    for step, (want, row) in enumerate(got["rows"], start=1):
        for tag, value in want.items():
            assert tag in row, (step, tag)
            tol = RATIO_TOL if "_to_data/" in tag else NORM_RTOL * abs(value) + 1e-30
            assert abs(row[tag] - value) <= tol, (step, tag, row[tag], value)
    lines = [cells for cells in map(str.split, got["described"].splitlines()) if cells]
    rows = {cells[0]: cells[1:4] for cells in lines if cells[0] in got["final"]}
    assert set(rows) == set(got["final"]) and "param0" not in got["described"]  # the model's names, not the buffers'
    assert rows["0.weight"] == ["48x16", "float32", "matrix"] and rows["1.weight"] == ["48", "float32", "vector"]
    logged = [int(line.split('"step": ')[1].split(",")[0].rstrip("}"))
              for line in (tmp_path / "monitored" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1))

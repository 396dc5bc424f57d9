"""The MLflow backend against a real tracking store (SQLite under the test's tmp directory), read back
with ``MlflowClient``: alone, in the user's active run, next to the Hugging Face Trainer with
``report_to="mlflow"`` and next to Lightning's ``MLFlowLogger``. Every logged step, value and step
number is compared with ``metrics.jsonl`` written beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import models
from models import train
from test_backends import read_jsonl
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.grouping import summarize

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from monitored_optim.backends.mlflow import metric_key  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite tracking store for the module (creating its tables takes seconds): its URI."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SQLAlchemy's deprecation notices about MLflow's own mappers
        MlflowClient(uri).search_experiments()
    return uri


@pytest.fixture
def tracking(store, monkeypatch, request) -> MlflowClient:
    """MLflow configured from its own variables, each test in an experiment of its own; no run is
    left active after the test."""
    from mlflow.tracking import _tracking_service, fluent

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", request.node.name)
    # what set_tracking_uri / set_experiment (Lightning's logger, HF's callback) leave process-wide
    monkeypatch.setattr(_tracking_service.utils, "_tracking_uri", None)
    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    yield MlflowClient(store)
    while mlflow.active_run() is not None:
        mlflow.end_run()


def runs(client: MlflowClient, experiment: str):
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


def history(client: MlflowClient, run_id: str, keys) -> dict[int, dict[str, float]]:
    """step -> {key: value} of ``keys`` in the run, every point of each key's history."""
    out: dict[int, dict[str, float]] = {}
    for key in keys:
        points = client.get_metric_history(run_id, key)
        assert len({p.step for p in points}) == len(points), (key, [p.step for p in points])  # one point per step
        for point in points:
            out.setdefault(point.step, {})[key] = point.value
    return out


def as_keys(rows: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return {step: {metric_key(tag): value for tag, value in row.items()} for step, row in rows.items()}


def test_own_run_holds_every_step_and_is_ended_at_close(tracking, tmp_path, monkeypatch, request):
    monkeypatch.setenv("MONITORED_OPTIM_BACKEND", "mlflow,jsonl")
    opt = train(models.mlp(), 6, logdir=tmp_path / "run", every=2)
    assert opt.monitor.settings.backends == ("mlflow", "jsonl")
    (run,) = runs(tracking, request.node.name)  # started from MLFLOW_EXPERIMENT_NAME
    assert run.info.status == "RUNNING" and mlflow.active_run().info.run_id == run.info.run_id
    opt.monitor.close()
    assert mlflow.active_run() is None
    run = tracking.get_run(run.info.run_id)
    assert run.info.status == "FINISHED"
    expected = as_keys(read_jsonl(tmp_path / "run"))
    assert sorted(expected) == [2, 4, 6]
    assert set(run.data.metrics) == set(expected[6])
    assert history(tracking, run.info.run_id, expected[6]) == expected  # every value at its step, exactly


def test_active_run_is_reused_and_left_open(tracking, tmp_path, request):
    with mlflow.start_run() as mine:
        mlflow.log_metric("loss", 1.5, step=1)
        opt = train(models.mlp(), 3, backend="mlflow,jsonl", logdir=tmp_path / "run")
        opt.monitor.close()
        assert mlflow.active_run().info.run_id == mine.info.run_id
        assert tracking.get_run(mine.info.run_id).info.status == "RUNNING"
    assert [r.info.run_id for r in runs(tracking, request.node.name)] == [mine.info.run_id]
    expected = as_keys(read_jsonl(tmp_path / "run"))
    assert history(tracking, mine.info.run_id, expected[3]) == expected
    assert tracking.get_run(mine.info.run_id).data.metrics["loss"] == 1.5


@pytest.mark.parametrize("named", [False, True], ids=["object", "object-and-name"])
def test_a_given_run_is_logged_into_and_left_to_its_owner(tracking, tmp_path, request, named):
    """``MlflowBackend(run_id=..., client=...)`` in ``MonitorConfig.backend`` (beside the name
    ``"mlflow"`` too) is the mlflow backend of that run: every step goes there, no other run is
    started, no run becomes active, and the run is still running after ``close``."""
    from monitored_optim.backends.mlflow import MlflowBackend

    experiment = tracking.create_experiment(request.node.name)
    given = tracking.create_run(experiment)
    backend = MlflowBackend(run_id=given.info.run_id, client=tracking)
    opt = train(models.mlp(), 3, backend=["mlflow", backend, "jsonl"] if named else [backend, "jsonl"],
                logdir=tmp_path / "run")
    opt.monitor.close()
    assert mlflow.active_run() is None
    assert [r.info.run_id for r in runs(tracking, request.node.name)] == [given.info.run_id]
    assert tracking.get_run(given.info.run_id).info.status == "RUNNING"
    expected = as_keys(read_jsonl(tmp_path / "run"))
    assert history(tracking, given.info.run_id, expected[3]) == expected


class Awkward(nn.Module):
    """Parameters whose tags MLflow refuses as they are: over 250 characters, a name that repeats
    across param groups (``@group1``), and layers grouped by depth over the tag budget (``*``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))
        self.long = nn.ModuleDict({"block_" + "x" * 240: nn.Linear(4, 4)})

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.long["block_" + "x" * 240](x)


def awkward() -> models.Problem:
    model = Awkward()
    named = list(model.named_parameters())
    groups = [{"params": named[:1]}, {"params": [("layers.0.weight", named[1][1])] + named[2:]}]  # a repeated name
    x = torch.randn(4, 16, 4)
    return models.Problem(model, groups, lambda i: model(x[i % 4]).pow(2).mean())


@pytest.mark.parametrize("budget", [2000, 80])
def test_every_tag_gets_a_valid_distinct_key(tracking, tmp_path, budget, request):
    opt = train(awkward(), 2, backend="mlflow,jsonl", logdir=tmp_path / "run", tag_budget=budget)
    tags = list(opt.monitor.latest)
    assert "update_to_data/layers.0.weight@group1" in tags
    assert max(len(tag) for tag in tags) > 250
    opt.monitor.close()
    (run,) = runs(tracking, request.node.name)
    sent = tags if budget == 2000 else list(summarize(opt.monitor.latest))
    assert any("*" in tag for tag in sent) == (budget == 80)
    keys = {metric_key(tag) for tag in sent}
    assert len(keys) == len(sent)  # no two tags share a key
    assert set(run.data.metrics) == keys  # the store refused none of them
    assert all(len(key) <= 250 for key in keys)
    assert metric_key("update_to_data/layers.0.weight@group1") == "update_to_data/layers.0.weight_group1"
    if budget == 2000:
        expected = as_keys(read_jsonl(tmp_path / "run"))
        assert history(tracking, run.info.run_id, expected[2]) == expected


def test_tags_that_would_share_a_key_get_keys_of_their_own(tracking, tmp_path, request):
    torch.manual_seed(0)
    a, b, c = (nn.Parameter(torch.randn(4, 4)) for _ in range(3))
    groups = [{"params": [("w", a)]}, {"params": [("w", b), ("w_group1", c)]}]  # "w@group1" and "w_group1"
    problem = models.Problem(nn.Module(), groups, lambda i: (a @ b @ c).pow(2).sum())
    opt = train(problem, 2, backend="mlflow,jsonl", logdir=tmp_path / "run")
    opt.monitor.close()
    (run,) = runs(tracking, request.node.name)
    assert {"update_to_data/w@group1", "update_to_data/w_group1"} <= set(opt.monitor.latest)
    assert len(run.data.metrics) == len(opt.monitor.latest)
    assert sorted(run.data.metrics.values()) == sorted(opt.monitor.latest.values())


def test_more_figures_than_one_batch_takes(tracking, tmp_path, request):
    """Over MLflow's 1,000 metrics per ``log_batch``: every figure arrives."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(120)])  # 240 tensors, 5 figures each
    x = torch.randn(8, 2)
    problem = models.Problem(model, [{"params": list(model.named_parameters())}], lambda i: model(x).pow(2).sum())
    opt = train(problem, 1, backend="mlflow,jsonl", logdir=tmp_path / "run")
    opt.monitor.close()
    (run,) = runs(tracking, request.node.name)
    expected = as_keys(read_jsonl(tmp_path / "run"))[1]
    assert len(expected) > 1000
    assert run.data.metrics == expected


def test_a_failing_store_is_warned_about_once_and_training_goes_on(tracking, tmp_path, request):
    problem = models.mlp()
    opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=MonitorConfig(
        backend="mlflow,jsonl", logdir=tmp_path / "run"))
    with pytest.warns(RuntimeWarning, match="the mlflow backend failed and is disabled") as caught:
        for i in range(4):
            if i == 2:
                (run,) = runs(tracking, request.node.name)
                tracking.delete_run(run.info.run_id)  # the store now refuses the run's metrics
            opt.zero_grad()
            problem.loss(i).backward()
            opt.step()
    assert len([w for w in caught if "mlflow" in str(w.message)]) == 1
    assert sorted(read_jsonl(tmp_path / "run")) == [1, 2, 3, 4]  # the other backend kept going
    opt.monitor.close()
    assert mlflow.active_run() is None  # the failed backend's own run was ended


def test_a_store_that_cannot_open_is_warned_about(tracking, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'file' / 'mlflow.db'}")  # under a file
    with pytest.warns(RuntimeWarning, match="the mlflow backend failed and is disabled"):
        opt = train(models.mlp(), 2, backend="mlflow,jsonl", logdir=tmp_path / "run")
    assert sorted(read_jsonl(tmp_path / "run")) == [1, 2]
    opt.monitor.close()


def test_own_run_is_ended_with_every_step_at_interpreter_exit(tracking, tmp_path, store, request):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import models
        opt = models.train(models.mlp(), 3, backend="mlflow")
        print(opt.monitor.latest["global/grad_norm"])
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]),
           "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (run,) = runs(tracking, request.node.name)
    assert run.info.status == "FINISHED"
    points = tracking.get_metric_history(run.info.run_id, "global/grad_norm")
    assert [p.step for p in points] == [1, 2, 3]
    assert points[-1].value == float(done.stdout.split()[-1])


transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")


def test_hf_trainer_reporting_to_mlflow_shares_its_run(tracking, tmp_path, request):
    from test_integrations import Tokens, tiny_gpt2

    model = tiny_gpt2()
    opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(
        backend="mlflow,jsonl", logdir=tmp_path / "monitor"))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=12, per_device_train_batch_size=4, logging_steps=4,
        save_strategy="no", report_to=["mlflow"], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(48), optimizers=(opt, None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trainer's own notices (tokenizer-free model, cpu)
        trainer.train()
    opt.monitor.close()
    (run,) = runs(tracking, request.node.name)  # one run: the Trainer's, which the monitor reused
    assert tracking.get_run(run.info.run_id).info.status == "FINISHED"  # ended by the Trainer
    expected = as_keys(read_jsonl(tmp_path / "monitor"))
    assert sorted(expected) == list(range(1, 13))
    assert history(tracking, run.info.run_id, expected[12]) == expected
    assert [p.step for p in tracking.get_metric_history(run.info.run_id, "loss")] == [4, 8, 12]


def test_lightning_mlflow_logger_shares_the_active_run(tracking, tmp_path, store, request):
    from lightning.pytorch.loggers import MLFlowLogger

    from test_integrations import LitModel, regression

    class Monitoring(LitModel):
        def configure_optimizers(self):
            return Monitored(torch.optim.AdamW)(self.named_parameters(), lr=1e-2, monitor=MonitorConfig(
                backend="mlflow,jsonl", logdir=self.logdir))

    with mlflow.start_run() as run:
        logger = MLFlowLogger(tracking_uri=store, run_id=run.info.run_id)
        module = Monitoring(True, tmp_path / "monitor")
        trainer = lightning.Trainer(max_steps=20, val_check_interval=10, logger=logger, accelerator="cpu",
                                    devices=1, enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, log_every_n_steps=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's notices (num_workers, cpu)
            trainer.fit(module, regression(200, 0), regression(16, 1))
        trainer.optimizers[0].monitor.close()
    assert [r.info.run_id for r in runs(tracking, request.node.name)] == [run.info.run_id]
    expected = as_keys(read_jsonl(tmp_path / "monitor"))
    assert sorted(expected) == list(range(1, 21))
    assert history(tracking, run.info.run_id, expected[20]) == expected
    # Lightning's own rows, at its global step (read before it is incremented: 4, 9, ...)
    assert [p.step for p in tracking.get_metric_history(run.info.run_id, "train_loss")] == [4, 9, 14, 19]
    assert [p.step for p in tracking.get_metric_history(run.info.run_id, "val_loss")] == [9, 19]


def test_lightning_callback_logs_into_the_mlflow_loggers_own_run(tracking, tmp_path, store, request, monkeypatch):
    """``MonitorCallback()`` beside an ``MLFlowLogger`` (no MLflow run active) and a ``CSVLogger``: the
    figures go into the logger's own run, step for step as the CSV logger's ``metrics.jsonl``, beside
    Lightning's rows; no other run is started, the logger's run is left to the logger, and the
    histograms are said once to have no place there."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

    from monitored_optim.lightning import MonitorCallback
    from test_integrations import LitModel, regression

    monkeypatch.delenv("MONITORED_OPTIM_EVERY", raising=False)  # log_every_n_steps sets the period
    logger = MLFlowLogger(experiment_name=request.node.name, tracking_uri=store)
    csv = CSVLogger(str(tmp_path / "csv"), name="lit")
    trainer = lightning.Trainer(max_steps=12, logger=[logger, csv], accelerator="cpu", devices=1,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                log_every_n_steps=4, callbacks=[MonitorCallback(MonitorConfig(
                                    figures="default,histograms"))])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(LitModel(False, tmp_path), regression(80, 0))
    assert mlflow.active_run() is None
    (run,) = runs(tracking, request.node.name)
    assert run.info.run_id == logger.run_id
    expected = as_keys(read_jsonl(Path(csv.log_dir)))
    expected = {step: {k: v for k, v in row.items() if k.startswith(("update_to_data", "grad_norm"))}
                for step, row in expected.items() if any(k.startswith("update_to_data") for k in row)}
    assert sorted(expected) == [4, 8, 12]
    assert history(tracking, run.info.run_id, expected[12]) == expected
    assert tracking.get_metric_history(run.info.run_id, "train_loss")
    told = [str(w.message) for w in seen if "mlflow backend shows no histograms" in str(w.message)]
    assert len(told) == 1, told


def test_histograms_are_said_once_to_have_no_place_in_mlflow(tracking, tmp_path, request):
    """``figures="default,histograms"``: MLflow has no histogram type, so one warning names it and
    the histograms are left out there; the scalar figures are logged at every step as usual."""
    with pytest.warns(UserWarning) as caught:
        opt = train(models.mlp(), 3, backend="mlflow,jsonl", logdir=tmp_path / "run", every=1,
                    figures="default,histograms")
    opt.monitor.close()
    told = [str(w.message) for w in caught if "histogram" in str(w.message)]
    assert len(told) == 1 and "mlflow" in told[0] and "MLflow has no histogram type" in told[0], told
    assert opt.monitor.histograms and (tmp_path / "run" / "histograms.jsonl").exists()
    (run,) = runs(tracking, request.node.name)
    expected = as_keys(read_jsonl(tmp_path / "run"))
    assert history(tracking, run.info.run_id, expected[3]) == expected

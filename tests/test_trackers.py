"""The trackio, SwanLab and Comet backends, read back from each tracker's own local store (``trackers.py``):
alone, in the user's open run, next to the Hugging Face Trainer's own reporting to the same tracker, at
interpreter exit, and with names each tracker would refuse or cut. Every figure read back equals
``opt.monitor.latest`` at its logging step, exactly (the three stores keep float64)."""

from __future__ import annotations

import signal
import sys
import warnings

import pytest
import torch
from torch import nn

import models
from test_backends import read_jsonl
from test_exit import run_child
from test_mlflow import awkward
from trackers import TRACKERS, Rows, remove_trackio_dir
from monitored_optim import Monitored, MonitorConfig
from monitored_optim.grouping import summarize

pytest.importorskip("trackio")
pytest.importorskip("swanlab")
pytest.importorskip("comet_ml")

from monitored_optim.backends.comet import comet_key  # noqa: E402
from monitored_optim.backends.names import Keys  # noqa: E402
from monitored_optim.backends.swanlab import swanlab_key  # noqa: E402
from monitored_optim.backends.trackio import trackio_key  # noqa: E402

KEYS = {"trackio": (trackio_key, 10_000), "swanlab": (swanlab_key, 512), "comet": (comet_key, 100)}


@pytest.fixture(scope="module", autouse=True)
def _trackio_dir():
    yield
    remove_trackio_dir()


@pytest.fixture(params=sorted(TRACKERS))
def tracker(request, monkeypatch, tmp_path):
    """Each tracker offline under the test's tmp directory, in a project named after the test; no run
    is left open after it."""
    found = TRACKERS[request.param]
    found.setup(monkeypatch, tmp_path, request.node.name)
    yield found
    found.cleanup()


def as_keys(name: str, rows: Rows) -> Rows:
    """``rows`` under the keys the backend gives the tags in one run."""
    keys = Keys(*KEYS[name])
    return {step: keys.rename(row) for step, row in rows.items()}


def only(rows: Rows, keys) -> Rows:
    return {step: {k: v for k, v in row.items() if k in keys} for step, row in rows.items() if keys & row.keys()}


def train(problem: models.Problem, steps: int, every: int = 1, **config) -> tuple[torch.optim.Optimizer, Rows]:
    """A monitored AdamW on ``problem``: the optimizer and ``opt.monitor.latest`` of every logging step."""
    opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=MonitorConfig(every=every, **config))
    latest: Rows = {}
    for i in range(steps):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()
        if opt.monitor.step % every == 0:
            latest[opt.monitor.step] = dict(opt.monitor.latest)
    return opt, latest


def test_own_run_holds_every_figure_at_its_step_and_is_closed(tracker, tmp_path):
    opt, latest = train(models.mlp(), 6, every=2, backend=f"{tracker.name},jsonl", logdir=tmp_path / "run")
    assert sorted(latest) == [2, 4, 6] and latest == read_jsonl(tmp_path / "run")
    opt.monitor.close()
    assert tracker.active() is None
    (rows,) = tracker.runs(tmp_path)  # one run, complete once close() returned
    assert rows == as_keys(tracker.name, latest)
    if tracker.name == "swanlab":  # plotted against the optimizer step, as in W&B
        assert {key: tracker.x_axes[key] for key in latest[6]} == dict.fromkeys(latest[6], "optimizer/step")


def test_open_run_is_reused_left_open_and_keeps_its_own_steps(tracker, tmp_path):
    """The user's run gets the figures; the user's own rows keep their steps: trackio's counted ones
    (logged without ``step=``), SwanLab's given ones, Comet's current step."""
    run = tracker.start()
    problem = models.mlp()
    opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=MonitorConfig(
        backend=tracker.name, logdir=tmp_path / "run"))
    if tracker.name == "comet":
        run.set_step(100)
    latest: Rows = {}
    for i in range(5):
        opt.zero_grad()
        problem.loss(i).backward()
        opt.step()
        latest[opt.monitor.step] = dict(opt.monitor.latest)
        if tracker.name == "trackio":
            run.log({"user/loss": 1.0 / (i + 1)})
        elif tracker.name == "swanlab":
            run.log({"user/loss": 1.0 / (i + 1)}, step=10 * (i + 1))
        else:
            run.log_metric("user/loss", 1.0 / (i + 1))
    opt.monitor.close()
    assert tracker.active() is run
    tracker.end(run)
    (rows,) = tracker.runs(tmp_path)
    expected = as_keys(tracker.name, latest)
    assert only(rows, set(expected[5])) == expected
    user = {step: row["user/loss"] for step, row in rows.items() if "user/loss" in row}
    steps = {"trackio": [0, 1, 2, 3, 4], "swanlab": [10, 20, 30, 40, 50], "comet": [100]}[tracker.name]
    assert sorted(user) == steps


@pytest.mark.parametrize("budget", [2000, 80])
def test_every_tag_gets_a_key_the_tracker_keeps(tracker, tmp_path, budget):
    """Names over Comet's 100 characters, ``@`` of a name repeated across groups, ``*`` of depth groups
    over the tag budget: every figure arrives under its own key, at its step."""
    opt, latest = train(awkward(), 2, backend=f"{tracker.name},jsonl", logdir=tmp_path / "run", tag_budget=budget)
    opt.monitor.close()
    tags = list(latest[2])
    assert "update_to_data/layers.0.weight@group1" in tags and max(len(tag) for tag in tags) > 250
    sent = {step: summarize(row) if budget == 80 else row for step, row in latest.items()}
    assert any("*" in tag for tag in sent[2]) == (budget == 80)
    expected = as_keys(tracker.name, sent)
    assert len(expected[2]) == len(sent[2])  # no two tags share a key
    (rows,) = tracker.runs(tmp_path)
    assert rows == expected


def test_keys_are_valid_and_stay_apart():
    long = "update_to_data/" + "block." * 100 + "weight"
    assert len(swanlab_key(long)) == 512 and len(comet_key(long)) == 100
    assert swanlab_key(long) != swanlab_key(long.replace("weight", "bias"))
    assert comet_key(long) != comet_key(long.replace("weight", "bias"))
    assert swanlab_key("g./update_to_data/x\tb.") == "g./update_to_data/x_b_"  # SwanLab would strip the end
    assert trackio_key("__g/global/grad_norm") == "_g/global/grad_norm"  # trackio would rename it
    keys = Keys(trackio_key, 10_000)
    assert keys("__g/a") == "_g/a" and keys("_g/a") != "_g/a" and keys("__g/a") == "_g/a"


transformers = pytest.importorskip("transformers")


def test_hf_trainer_reporting_to_the_tracker_shares_its_run(tracker, tmp_path, monkeypatch):
    """``report_to`` the same tracker: one run holds the Trainer's rows at the steps it gives them
    and the monitor's figures at their optimizer steps. SwanLab 0.10 needs the run opened first:
    transformers 5's callback calls ``swanlab.get_run()``, which raises without one."""
    from test_integrations import Tokens, tiny_gpt2

    run = tracker.start() if tracker.name == "swanlab" else None
    model = tiny_gpt2()
    opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(
        backend=f"{tracker.name},jsonl", logdir=tmp_path / "monitor"))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=12, per_device_train_batch_size=4, logging_steps=4,
        save_strategy="no", report_to=[tracker.report_to], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
        **({"project": tracker.project} if tracker.name == "trackio" else {}))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(48), optimizers=(opt, None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trainer's and trackers' own notices (tokenizer-free model, cpu)
        trainer.train()
    latest = dict(opt.monitor.latest)
    opt.monitor.close()
    if run is not None:
        tracker.end(run)
    tracker.cleanup()  # what the Trainer leaves open (Comet's experiment) ends with the process
    (rows,) = tracker.runs(tmp_path)  # one run: the Trainer's, which the monitor reused
    jsonl = read_jsonl(tmp_path / "monitor")
    assert sorted(jsonl) == list(range(1, 13)) and jsonl[12] == latest
    expected = as_keys(tracker.name, jsonl)
    assert only(rows, set(expected[12])) == expected
    trainer_steps = sorted(step for step, row in rows.items() if "train/loss" in row)
    # trackio counts the Trainer's rows itself (each carries train/global_step); the others take its step
    assert trainer_steps == ([0, 1, 2] if tracker.name == "trackio" else [4, 8, 12])
    if tracker.name == "trackio":
        assert [rows[s]["train/global_step"] for s in trainer_steps] == [4, 8, 12]


@pytest.mark.parametrize("how", ["end", "ctrl-c", "sigterm-exit"])
def test_every_row_is_kept_at_interpreter_exit(tracker, tmp_path, how):
    """A script that never calls ``close()`` (``exit_child.py``), ending normally, by Ctrl-C or by a
    SIGTERM handler that exits: the run holds every logging step."""
    returncode, latest, stderr = run_child(how, tracker.name, tmp_path)
    expected = {"end": {0}, "ctrl-c": {-signal.SIGINT}, "sigterm-exit": {128 + signal.SIGTERM}}[how]
    if tracker.name == "comet" and how == "ctrl-c":  # Comet's own exit handler, archiving its offline
        expected.add(1)                              # run, sometimes ends the process with status 1
    assert returncode in expected, stderr
    assert "monitored_optim:" not in stderr
    (rows,) = tracker.runs(tmp_path)
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert rows[5] == as_keys(tracker.name, {5: latest})[5]


FAILING = {
    "swanlab": ("SWANLAB_MODE", "online"),  # no API key, no terminal to ask for one
    "comet": ("COMET_START_ONLINE", "true"),  # no API key
    "trackio": ("TRACKIO_SERVER_URL", "not-a-url"),  # refused before anything is sent
}


def test_a_tracker_that_cannot_start_is_warned_about_once_and_training_goes_on(tracker, tmp_path, monkeypatch):
    monkeypatch.setenv(*FAILING[tracker.name])
    with pytest.warns(RuntimeWarning, match=f"the {tracker.name} backend failed and is disabled") as caught:
        opt, latest = train(models.mlp(), 3, backend=f"{tracker.name},jsonl", logdir=tmp_path / "run")
    assert len([w for w in caught if "backend failed" in str(w.message)]) == 1
    assert read_jsonl(tmp_path / "run") == latest  # the other backend kept going
    opt.monitor.close()


def test_a_missing_package_fails_at_construction_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "comet_ml", None)  # as if it were not installed
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "comet_ml" else object())
    with pytest.raises(ImportError,
                       match=r"backend 'comet' needs the comet_ml package: pip install 'monitored_optim\[comet\]'"):
        Monitored(torch.optim.SGD)(nn.Linear(2, 2).parameters(), lr=0.1, monitor=MonitorConfig(backend="comet"))


def test_lightning_comet_logger_shares_its_experiment(tmp_path, monkeypatch):
    """Lightning's ``CometLogger`` opens the experiment before ``configure_optimizers``: one archive
    holds Lightning's metrics at the steps Lightning gives them and every logging step's figures at
    its optimizer step."""
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CometLogger
    from test_integrations import LitModel, regression

    comet = TRACKERS["comet"]
    comet.setup(monkeypatch, tmp_path, "lightning-comet")
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")  # what CometLogger sets for good, undone after
    latest: Rows = {}
    logged: list[tuple[int, str]] = []  # (step, name) of each metric Lightning logs

    class Lit(LitModel):
        def configure_optimizers(self):
            return Monitored(torch.optim.AdamW)(self.named_parameters(), lr=1e-2, monitor=MonitorConfig(
                backend="comet", every=3, logdir=self.logdir))

        def on_train_batch_end(self, *_):
            opt = self.trainer.optimizers[0]
            if opt.monitor.step % 3 == 0:
                latest[opt.monitor.step] = dict(opt.monitor.latest)

    class Logger(CometLogger):
        def log_metrics(self, metrics, step=None):
            logged.extend((step, name) for name in metrics if name != "epoch")
            super().log_metrics(metrics, step)

    logger = Logger(offline_directory=str(tmp_path / "lightning"), project="lightning-comet")
    trainer = lightning.Trainer(max_steps=30, val_check_interval=10, logger=logger, accelerator="cpu", devices=1,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                log_every_n_steps=5)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's notices (num_workers, cpu)
            trainer.fit(Lit(True, tmp_path / "monitor"), regression(200, 0), regression(16, 1))
        opt = trainer.optimizers[0]
        assert opt.monitor.step == trainer.global_step == 30 and sorted(latest) == list(range(3, 31, 3))
        opt.monitor.close()
        assert comet.active() is logger.experiment  # left open for Lightning
    finally:
        comet.cleanup()
    (rows,) = comet.runs(tmp_path)  # one experiment: the logger's
    expected = as_keys("comet", latest)
    assert only(rows, set(expected[30])) == expected
    own = {"train_loss", "val_loss"}
    assert sorted((step, name) for step, row in rows.items() for name in row if name in own) == sorted(logged)
    assert {name for _, name in logged} == own


def test_trackio_keeps_the_guards_alerts_with_the_run(tmp_path, monkeypatch):
    """An alert goes to trackio's own ``alert`` of the run the figures go to, read back from its store:
    one ``skipped`` at WARN and one ``stalled`` at ERROR, their titles and the layer named."""
    from trackio.sqlite_storage import SQLiteStorage

    trackio = TRACKERS["trackio"]
    trackio.setup(monkeypatch, tmp_path, "guard-alerts")
    problem = models.mlp()
    opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=MonitorConfig(
        every=2, backend="trackio", guard="nonfinite", skip_budget=1, alerts="skipped,stalled"))
    for i in range(5):
        opt.zero_grad()
        problem.loss(i).backward()
        if i >= 2:
            opt.param_groups[0]["params"][0].grad.view(-1)[0] = float("nan")
        opt.step()
    opt.monitor.close()
    alerts = SQLiteStorage.get_alerts(trackio.project)
    assert sorted((a["title"], a["level"]) for a in alerts) == [("monitored_optim: skipped at step 3", "warn"),
                                                                ("monitored_optim: stalled at step 3", "error")]
    assert all("fc1.weight" in a["text"] or "steps skipped in a row" in a["text"] for a in alerts)
    trackio.cleanup()

"""TRL's trainers (``SFTTrainer``, ``DPOTrainer``) with ``callbacks=[MonitorCallback(...)]``: the callback
monitors the optimizer TRL's Trainer subclass built, with its settings kept; each run equals the plain
one bit for bit; the figures read back from ``metrics.jsonl`` equal the clone truth taken by the
optimizer's own step hooks at every step; the x axis is the trainer's global step. Everything local: a
tiny random GPT-2 and a word-level tokenizer built here, small in-memory datasets."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from test_callbacks import TruthCallback, inner
from truth import assert_figures_match

from monitored_optim import MonitorConfig

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

STEPS = 4
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "rug", "fast", "slow", "red", "blue", "big",
         "small", "and", "then", "is", "was"]


def tokenizer():
    """A word-level tokenizer over :data:`WORDS`, with pad and eos tokens (nothing from the hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def sentences(n: int, length: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=gen)) for _ in range(n)]


def gpt2(tok):
    """The tiny random GPT-2 of tests/test_integrations.py over ``tok``'s vocabulary and special tokens."""
    from test_integrations import tiny_gpt2

    model = tiny_gpt2(len(tok))
    for config in (model.config, model.generation_config):
        config.bos_token_id = config.eos_token_id = tok.eos_token_id
        config.pad_token_id = tok.pad_token_id
    return model


def sft_trainer(tmp_path: Path, callbacks: list):
    tok = tokenizer()
    train = datasets.Dataset.from_dict({"text": sentences(16, 10, 0)})
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, max_length=16,
                         logging_steps=2, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                         dataloader_num_workers=0, disable_tqdm=True)
    return trl.SFTTrainer(model=gpt2(tok), args=args, train_dataset=train, processing_class=tok,
                          callbacks=callbacks)


def dpo_trainer(tmp_path: Path, callbacks: list):
    tok = tokenizer()
    completions = {key: [" " + s for s in sentences(16, 5, seed)] for key, seed in (("chosen", 1), ("rejected", 2))}
    train = datasets.Dataset.from_dict({"prompt": sentences(16, 4, 0), **completions})  # prompt + completion: words
    args = trl.DPOConfig(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, max_length=16,
                         logging_steps=2, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                         dataloader_num_workers=0, disable_tqdm=True)
    # a second tiny model as the reference (ref_model=None would load the policy's hub name again)
    return trl.DPOTrainer(model=gpt2(tok), ref_model=gpt2(tok), args=args, train_dataset=train,
                          processing_class=tok, callbacks=callbacks)


def trl_run(build, tmp_path: Path, monitored: bool, config: MonitorConfig | None = None):
    """Train with ``build``'s trainer; returns it, the clone truth of each step and the library's warnings."""
    from monitored_optim.hf import MonitorCallback

    truth = TruthCallback()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # the trainers' own notices (deprecated arguments, cpu) are kept here
        trainer = build(tmp_path, [MonitorCallback(config), truth] if monitored else [truth])
        trainer.train()
    ours = [str(w.message) for w in seen if str(w.message).startswith("monitored_optim")]
    return trainer, truth.truths.steps, ours


@pytest.mark.parametrize("build", [sft_trainer, dpo_trainer], ids=["sft", "dpo"])
def test_trl_trainer_is_monitored_with_its_own_optimizer_bit_for_bit(tmp_path, build):
    plain, _, _ = trl_run(build, tmp_path / "plain", False)
    trainer, truths, ours = trl_run(build, tmp_path / "monitored", True,
                                    MonitorConfig(backend="jsonl", logdir=tmp_path / "logs"))
    assert ours == []
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), trainer.model.parameters(), strict=True))
    opt, plain_opt = inner(trainer.optimizer), inner(plain.optimizer)
    assert type(opt).__mro__[1] is type(plain_opt)
    settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert settings == [{k: v for k, v in g.items() if k != "params"} for g in plain_opt.param_groups]
    assert len(settings) == 2 and settings[1]["weight_decay"] == 0.0  # the Trainer's decay / no-decay groups
    assert [[p.shape for p in g["params"]] for g in opt.param_groups] == \
        [[p.shape for p in g["params"]] for g in plain_opt.param_groups]
    assert opt.monitor.step == trainer.state.global_step == STEPS
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # conftest's MONITORED_OPTIM_EVERY=1
    assert len(truths) == STEPS
    lrs = [trainer.args.learning_rate * (STEPS - i) / STEPS for i in range(STEPS)]  # TRL's linear schedule
    assert [row[f"lr/group{i}"] for row in rows for i in (0, 1)] == pytest.approx([lr for lr in lrs for _ in (0, 1)])
    for row in rows:
        assert_figures_match({k: v for k, v in row.items() if not k.startswith(("update_lost/", "step"))},
                             truths[row["step"] - 1])
    # the policy's parameters only, under the model's names (DPO's reference model is not stepped)
    names = {k.split("/", 1)[1] for k in rows[-1] if k.startswith("update_norm/")}
    assert names == {n for n, p in trainer.model.named_parameters() if p.requires_grad}

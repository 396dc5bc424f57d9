"""Child process of test_deepspeed.py: the HF Trainer with ``deepspeed=`` given a monitored optimizer
through ``optimizers=``, which it replaces by its own, in one process. Usage:
``python replaced_child.py PORT OUTDIR``; prints the Trainer's step count and its optimizer's class."""

import os
import sys

import torch

os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])

import transformers  # noqa: E402

from monitored_optim import Monitored, MonitorConfig  # noqa: E402
from test_integrations import Tokens, tiny_gpt2  # noqa: E402

model = tiny_gpt2()
opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-3,
                                   monitor=MonitorConfig(backend="jsonl", logdir=sys.argv[2]))
args = transformers.TrainingArguments(
    output_dir=sys.argv[2], max_steps=2, per_device_train_batch_size=2, save_strategy="no", report_to=[],
    disable_tqdm=True, deepspeed={"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}})
trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(8), optimizers=(opt, None))
trainer.train()
print(trainer.state.global_step, type(trainer.model_wrapped.basic_optimizer).__name__, flush=True)

"""Child process of test_exit.py: five logging steps, then it ends the way ``HOW`` says, without
calling ``close()`` unless told. It prints the last step's figures (one JSON line) once they are
logged. Usage: ``python exit_child.py HOW BACKENDS LOGDIR`` with ``HOW`` one of ``end`` (the script
ends), ``ctrl-c`` (KeyboardInterrupt raised in the loop), ``sigterm-exit`` (its SIGTERM handler
raises SystemExit), ``sigterm-close`` (its handler closes the monitor, then exits) and ``sigterm``
(Python's default SIGTERM handling); the ``sigterm*`` ones then wait for the signal."""

import json, signal, sys, time

import torch
from monitored_optim import Monitored, MonitorConfig

how, backends, logdir = sys.argv[1:4]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
x, y = torch.randn(16, 6), torch.randn(16, 4)
opt = Monitored(torch.optim.AdamW)(model.named_parameters(), lr=1e-2, monitor=MonitorConfig(
    backend=backends, logdir=logdir, every=1))
if how == "sigterm-exit":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
elif how == "sigterm-close":
    def close_and_exit(signum, frame):
        opt.monitor.close()
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, close_and_exit)
for i in range(5):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if i == 4:
        print(json.dumps(opt.monitor.latest), flush=True)
        if how == "ctrl-c":
            raise KeyboardInterrupt
if how.startswith("sigterm"):  # short sleeps: a signal that lands on another thread (a tracker's) runs
    for _ in range(1200):        # its Python handler only when the main thread runs again, as a loop does
        time.sleep(0.1)

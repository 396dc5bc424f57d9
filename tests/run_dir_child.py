"""Child process of test_run_dir.py: trains the tests' MLP with a monitored AdamW that logs every step
to the backend and logdir of MONITORED_OPTIM_BACKEND and MONITORED_OPTIM_LOGDIR, its step axis
continuing from START (a resumed run). Usage: ``python run_dir_child.py START STEPS MODE``.

MODE: ``plain``; ``hold``: after the last step print ``logged`` and wait until stdin closes (a
process still running); ``fork``: after the last step fork a child that sleeps (a pool's worker),
print its pid and SIGKILL itself; ``two``: two optimizers with tag prefixes ``a`` and ``b`` in the one logdir;
``limit=BYTES``: under a file-size limit of BYTES with SIGXFSZ's default action, so that the kernel
cuts the row that crosses the limit and kills the process at its next write."""

import os, resource, signal, sys, time, warnings
start, steps, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if mode.startswith("limit="):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(mode[6:]), int(mode[6:])))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models
from monitored_optim import Monitored, MonitorConfig
warnings.simplefilter("always")
runs = []
for prefix in ("a", "b") if mode == "two" else (None,):
    problem = models.mlp()
    opt = Monitored(torch.optim.AdamW)(problem.groups, lr=1e-2, monitor=MonitorConfig(every=1, prefix=prefix))
    opt.monitor.step = start
    runs.append((problem, opt))
for i in range(steps):
    for problem, opt in runs:
        opt.zero_grad(); problem.loss(i).backward(); opt.step()
if mode == "hold":
    print("logged", flush=True)
    sys.stdin.read()
if mode == "fork":
    worker = os.fork()
    if worker == 0:
        for fd in (1, 2):  # let go of the parent's pipes
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        time.sleep(60)
        os._exit(0)
    print(worker, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

"""Child process of test_full_disk.py: trains 60 steps under a file-size limit (RLIMIT_FSIZE), so
that every write past the limit fails with EFBIG, and prints the steps done, the slowest
``opt.step()`` and the time ``close()`` took. Usage: ``python full_disk_child.py BACKEND LOGDIR BYTES``."""

import signal, sys, time, warnings, resource
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
import torch
from monitored_optim import Monitored, MonitorConfig
warnings.simplefilter("always")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
opt = Monitored(torch.optim.SGD)(model.named_parameters(), lr=0.1,
                                 monitor=MonitorConfig(backend=sys.argv[1], logdir=sys.argv[2]))
x, y = torch.randn(16, 32), torch.randn(16, 8)
slowest = 0.0
for _ in range(60):
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward()
    t = time.perf_counter(); opt.step(); slowest = max(slowest, time.perf_counter() - t)
t = time.perf_counter(); opt.monitor.close()
print("done", opt.monitor.step, f"{slowest:.3f}", f"{time.perf_counter() - t:.3f}", flush=True)

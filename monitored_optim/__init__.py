"""monitored_optim: the true update of every parameter, measured inside ``optimizer.step()``.

Change one line, ``torch.optim.AdamW`` to ``Monitored(torch.optim.AdamW)``, and each layer's
update-to-data ratio log10(std(Δθ) / std(θ)) goes to TensorBoard, W&B or a JSON-lines file; or
``attach(optimizer)`` to one that a framework built.
"""

from .attach import attach, monitor_of
from .config import MonitorConfig
from .monitored import Monitored

__all__ = ["Monitored", "MonitorConfig", "attach", "monitor_of"]
__version__ = "0.1.0"

"""Views for optimizers of other packages, used where the package is installed in a version checked.

None of these packages is a dependency, and none is imported here: a class is matched by its
module and name when an optimizer class is first monitored (it is in that class's MRO, so its
package is already imported), and only where the installed distribution's version starts with the
one its view was written for. Elsewhere the optimizer keeps the clone fallback.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from importlib import metadata

from .bnb_adam import BnbAdamView
from .hf_adafactor import HfAdafactorView
from .lion import LucidrainsLionView, OptimizerLionView
from .prodigy import ProdigyView
from .schedulefree import AdamWScheduleFreeView, RAdamScheduleFreeView, SGDScheduleFreeView
from .turns import Lookup, TurnView
from .view import View

VIEWS: dict[tuple[str, str], tuple[str, str, View]] = {
    ("lion_pytorch.lion_pytorch", "Lion"): ("lion-pytorch", "0.2.", LucidrainsLionView()),
    ("pytorch_optimizer.optimizer.lion", "Lion"): ("pytorch_optimizer", "4.1.", OptimizerLionView()),
    ("bitsandbytes.optim.optimizer", "Optimizer8bit"): ("bitsandbytes", "0.50.", BnbAdamView()),
    ("prodigyopt.prodigy", "Prodigy"): ("prodigyopt", "1.1.", ProdigyView()),
    ("transformers.optimization", "Adafactor"): ("transformers", "5.", HfAdafactorView()),
    ("schedulefree.adamw_schedulefree", "AdamWScheduleFree"): ("schedulefree", "1.4.", AdamWScheduleFreeView()),
    ("schedulefree.sgd_schedulefree", "SGDScheduleFree"): ("schedulefree", "1.4.", SGDScheduleFreeView()),
    ("schedulefree.radam_schedulefree", "RAdamScheduleFree"): ("schedulefree", "1.4.", RAdamScheduleFreeView()),
    ("torchao.optim.adam", "_AdamBase"): ("torchao", "0.18.", TurnView(Lookup())),  # 8-bit, 4-bit, FP8 AdamW
    ("galore_torch.adamw", "AdamW"): ("galore-torch", "1.0", TurnView(Lookup())),
    ("galore_torch.adamw8bit", "AdamW8bit"): ("galore-torch", "1.0", TurnView(Lookup("initialized"))),
}
"""(module, class name) -> (distribution, version prefix its view was written for, view)."""


def views_in(cls: type) -> Iterator[tuple[type, View]]:
    """``(base, view)`` for each class of ``cls``'s MRO that has a view here, in a checked version."""
    for base in cls.__mro__:
        found = VIEWS.get((base.__module__, base.__qualname__))
        if found is not None and _installed(found[0]).startswith(found[1]):
            yield base, found[2]


@functools.cache
def _installed(distribution: str) -> str:
    """The installed version of ``distribution``, or "" where it has no metadata."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""

"""The models a monitor names the optimizer's parameters after, those it watches, and the one rule
that names a parameter as the model itself does, whatever wraps it.

The rule (:func:`own_names`, :func:`own_named_parameters`): a parameter's name is the one the plain
model gives it, so that a layer has one tag in a one-process debugging run and under N processes.

- A component in :data:`WRAPPING` (``_orig_mod``, ``_fsdp_wrapped_module``,
  ``_checkpoint_wrapped_module``, ``_forward_module``, ``_original_module``) is left out wherever it
  is: these are the names under which ``torch.compile``, FSDP1, activation checkpointing and
  Lightning (Fabric's ``_FabricModule``, the strategies' wrapper) hold the module they wrap.
- A ``module`` component is left out only where it is a wrapper's of :data:`HOLDERS` (DDP,
  ``DataParallel``, a DeepSpeed engine), for a model may name a module of its own ``module``. Where a
  model is given (``MonitorConfig(model=)``, ``watch``, ``attach(engine)``), the wrappers are its
  modules of those types. Where only names are given (``named_parameters()``, ``param_names``), they
  are the wrappers alive that hold the named tensor under that name (its end, when a module of the
  user's holds the wrapper); they are found once by a scan of the garbage collector's objects, done
  only for names with a ``module`` component that no wrapper found before explains.

``DDP(net).named_parameters()``, ``DDP(net)`` given as ``model=``, ``torch.compile(DDP(net))``,
Fabric's ``setup(net)`` and a DeepSpeed engine of ``net`` all name ``net``'s layers as
``net.named_parameters()`` does. Limits: a module of the model's own named like a :data:`WRAPPING`
component loses that component; a wrapper outside :data:`HOLDERS` (apex's DDP, one of the user's)
keeps its ``module.``; a tensor that a user's module holds as ``module.x`` while a DDP also holds it
as ``module.x`` (a DDP of the user's ``module`` alone) is taken for the DDP's. Two parameters whose
names meet once the wrappers are left out stay apart: the plan appends ``@group{i}`` to the second
(:func:`~monitored_optim.capture.plan.names`).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

WRAPPING = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module",
                      "_original_module"})
"""The names under which wrappers hold the module they wrap, which models do not give modules of
their own: ``torch.compile``'s ``OptimizedModule``, FSDP1's ``FullyShardedDataParallel``, the
activation checkpointing and offloading wrappers of ``torch.distributed.algorithms._checkpoint``,
Lightning Fabric's ``_FabricModule`` and Lightning's strategy wrapper."""

HOLDERS = frozenset({("torch", "DistributedDataParallel"), ("torch", "DataParallel"), ("deepspeed", "DeepSpeedEngine")})
"""The wrappers that hold the model as ``module`` (a name a model may give a module of its own),
as (top package, class name) of a class in their MRO: DDP (Ray Train's and accelerate's too),
``DataParallel``, and DeepSpeed's engine (its pipeline engine too)."""

_INNER: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter -> the names (:data:`WRAPPING` components left out) under which :data:`HOLDERS`
wrappers met so far hold it."""


class Models:
    """The names of parameters after the models that hold them, and the models watched.

    Attributes:
        names: id of a parameter -> its name as the first model that holds it gives it (the plain
            model's inside its wrappers: :func:`own_named_parameters`; a name known before stays).
    """

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self._watched: list[weakref.ref[torch.nn.Module]] = []

    def name_after(self, model: torch.nn.Module) -> None:
        """Name the parameters ``model`` holds as the plain model inside its wrappers names them
        (:func:`own_named_parameters`); a name goes with its parameter (another tensor may take its
        id then)."""
        for name, p in own_named_parameters(model):
            self.name(p, name)

    def name(self, p: torch.Tensor, name: str) -> None:
        """Name ``p`` ``name`` unless it has a name; the name goes with ``p`` (another tensor may take
        its id then)."""
        if id(p) not in self.names:
            self.names[id(p)] = name
            weakref.finalize(p, self.names.pop, id(p), None)

    def watch(self, model: torch.nn.Module) -> None:
        """Name the parameters after ``model``, and keep it (weakly) among the models watched."""
        self._watched.append(weakref.ref(model))
        self.name_after(model)

    def watched(self) -> list[torch.nn.Module]:
        """The models watched that are alive."""
        return [model for model in (ref() for ref in self._watched) if model is not None]


def unnamed(k: int) -> str:
    """The name of the ``k``-th parameter of an optimizer that has no name for it: ``param{k}``."""
    return f"param{k}"


def is_unnamed(name: str) -> bool:
    """Whether ``name`` is one :func:`unnamed` gives (or the bare ``param``)."""
    return name == "param" or name.startswith("param") and name[5:].isdigit()


def holds(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a wrapper of :data:`HOLDERS`, which holds the model as ``module``."""
    return any((cls.__module__.partition(".")[0], cls.__name__) in HOLDERS for cls in type(module).__mro__)


def own_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()`` under the names the plain model gives them (the rule of
    :mod:`monitored_optim.models`): ``DDP(net)``'s ``module.0.weight`` and ``torch.compile(net)``'s
    ``_orig_mod.0.weight`` are ``0.weight``; a module of the model's own named ``module`` stays."""
    for holder in model.modules():
        if holds(holder):
            _remember(holder)
    named = list(model.named_parameters())
    return list(zip(own_names(named, scan=False), (p for _, p in named)))


def own_names(named: Iterable[tuple[str, torch.Tensor]], scan: bool = True) -> list[str]:
    """The names the plain model gives the parameters ``named`` (``(name, tensor)`` pairs as a
    wrapper's ``named_parameters()`` gives them; the rule of :mod:`monitored_optim.models`).

    ``scan``: look for the :data:`HOLDERS` wrappers alive (a garbage collector scan) where a name's
    ``module`` component is none that the wrappers met so far explain."""
    named = list(named)
    out = [_own(name, p) for name, p in named]
    if scan and any("module" in own.split(".")[:-1] for own in out):
        for obj in gc.get_objects():  # type(), not isinstance(): no __class__ lookups (deprecation proxies warn)
            if issubclass(type(obj), torch.nn.Module) and holds(obj):
                _remember(obj)
        out = [_own(name, p) for name, p in named]
    return out


def _own(name: str, p: torch.Tensor) -> str:
    """``name`` with the :data:`WRAPPING` components left out, and the ``module`` of each wrapper met
    so far that holds ``p`` under it (the one whose name for ``p`` is the longest end of it first)."""
    *path, leaf = name.split(".")
    name = ".".join([*(part for part in path if part not in WRAPPING), leaf])
    inner_names = _INNER.get(p, ())
    while "module" in name.split(".")[:-1]:
        inner = max((h for h in inner_names if name == h or name.endswith("." + h)), key=len, default=None)
        if inner is None:
            break
        name = name[:len(name) - len(inner)] + inner[len("module."):]
    return name


def _remember(holder: torch.nn.Module) -> None:
    """Remember the names under which ``holder`` (a wrapper of :data:`HOLDERS`) holds its parameters."""
    for name, p in holder.named_parameters():
        *path, leaf = name.split(".")
        path = [part for part in path if part not in WRAPPING]
        if path[:1] == ["module"]:
            _INNER.setdefault(p, set()).add(".".join([*path, leaf]))

"""The models a monitor names the optimizer's parameters after, and those it watches."""

from __future__ import annotations

import weakref

import torch


class Models:
    """The names of parameters after the models that hold them, and the models watched.

    Attributes:
        names: id of a parameter -> its name as the first model that holds it gives it
            (``model.named_parameters()``; a name known before stays).
    """

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self._watched: list[weakref.ref[torch.nn.Module]] = []

    def name_after(self, model: torch.nn.Module) -> None:
        """Name the parameters ``model`` holds as ``model.named_parameters()`` does (of the module
        ``torch.compile`` wrapped: no ``_orig_mod.`` prefix); a name goes with its parameter (another
        tensor may take its id then)."""
        for name, p in unwrapped(model).named_parameters():
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


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(model)`` wrapped (whose parameters' names have no ``_orig_mod.``
    prefix), else ``model``."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def unwrapped_name(name: str) -> str:
    """A parameter's name as the model itself gives it: without the ``_orig_mod`` components that the
    wrappers of ``torch.compile`` put in their modules' names (``body._orig_mod.0.weight`` ->
    ``body.0.weight``)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod") if "_orig_mod" in name else name

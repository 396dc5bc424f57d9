"""DeepSpeed: the flat fp32 buffers its wrappers hand the optimizer, mapped back to the model's parameters.

``deepspeed.initialize(optimizer=Monitored(cls)(...))`` wraps the optimizer in one of these classes,
which replace each param group's parameters by fp32 tensors of their own and call the optimizer's
``step()`` once per group, per sub-group, or once for all:

==========================================  ===============================================  ============
wrapper (stage, precision)                  what the optimizer steps                          step() calls
==========================================  ===============================================  ============
``FP16_UnfusedOptimizer`` (0, bf16/fp16)    an fp32 copy of each parameter, on every rank     one, and one
                                                                                              at build
``FP16_Optimizer`` (0, fp16, FusedAdam)     one flat fp32 copy per group, on every rank       one, and one
                                                                                              at build
``BF16_Optimizer`` (1, bf16)                this rank's partition of each group's flat copy   one
``DeepSpeedZeroOptimizer`` (1 and 2)        this rank's partition of each group's flat copy   one per group
``DeepSpeedZeroOptimizer_Stage3`` (3)       this rank's partition of each parameter, laid     one per
                                            end to end per sub-group                          sub-group
==========================================  ===============================================  ============

A :class:`Layout` lists, for each flat tensor the optimizer steps, the model's parameters it holds
as :class:`~.held.Held` fragments (``span`` in the flat tensor, ``source`` the model's parameter);
the padding after the last one is in none. Stage 0 copies are replicas; a ZeRO partition's elements
are on one rank only. The monitor counts one step per call of the wrapper's own ``step()``
(:func:`find` and :func:`engine_step`): the calls it makes inside count once, and the step the
FP16 wrappers take at build time to create the optimizer's state is not one.

Sources: ``deepspeed/runtime/fp16/{unfused,fused}_optimizer.py``, ``deepspeed/runtime/bf16_optimizer.py``,
``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py``, ``deepspeed/utils/mixed_precision_linkage.py``
(``_hp_mapping``: each parameter's fragment of the flat partition), DeepSpeed 0.19.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from types import FrameType, SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..models import is_unnamed, own_names
from .held import Held, whole_shape

WRAPPERS = ("FP16_UnfusedOptimizer", "FP16_Optimizer", "BF16_Optimizer", "DeepSpeedZeroOptimizer",
            "DeepSpeedZeroOptimizer_Stage3")
"""The DeepSpeed classes whose ``optimizer`` attribute is the optimizer they step."""


def is_wrapper(obj: object) -> bool:
    """Whether ``obj`` is one of DeepSpeed's :data:`WRAPPERS`."""
    return type(obj).__name__ in WRAPPERS and type(obj).__module__.startswith("deepspeed.")


def find(optimizer: torch.optim.Optimizer) -> tuple[Any, bool] | None:
    """The DeepSpeed wrapper now calling ``optimizer.step()``, and whether from inside its own ``step()``.

    Looks up the call stack (a few frames) for a method of one of :data:`WRAPPERS` whose ``self``
    wraps ``optimizer``; ``None`` where there is none (no DeepSpeed, or the engine steps the
    optimizer itself: stage 0 in fp32).
    """
    if "deepspeed" not in sys.modules:
        return None
    frame: FrameType | None = sys._getframe(1)
    wrapper = None
    while frame is not None:
        owner = frame.f_locals.get("self")
        if wrapper is None and is_wrapper(owner) and getattr(owner, "optimizer", None) is optimizer:
            wrapper = owner
        if wrapper is not None and owner is wrapper and frame.f_code.co_name == "step":  # under any decorator
            return wrapper, True
        frame = frame.f_back
    return None if wrapper is None else (wrapper, False)


def engine_step(wrapper: Any, run: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]) -> None:
    """Make ``wrapper.step`` call ``run(step, args, kwargs)`` with its own ``step`` (the engine's
    optimizer step, which the monitor counts once); ``run`` is held weakly through its object."""
    step, ref = wrapper.step, weakref.WeakMethod(run)

    def monitored_step(*args: Any, **kwargs: Any) -> Any:
        hook = ref()
        return step(*args, **kwargs) if hook is None else hook(step, args, kwargs)

    wrapper.step = monitored_step


class Layout:
    """The flat tensors a DeepSpeed wrapper's optimizer steps, and the model's parameters in them.

    Args:
        wrapper: the DeepSpeed wrapper (one of :data:`WRAPPERS`).
        born: id -> name of the parameters the optimizer was built with (``param{k}`` where unnamed).
        known: id -> name of the parameters of watched models.

    A parameter is named as its param group named it, else as a watched model or DeepSpeed's
    engine (``model.named_parameters()``) names it, else ``param{k}``: each the plain model's name
    (:func:`~monitored_optim.models.own_names`).
    """

    def __init__(self, wrapper: Any, born: dict[int, str], known: dict[int, str]) -> None:
        self.wrapper = weakref.ref(wrapper)  # the wrapper holds the optimizer, which holds the monitor
        engine = getattr(wrapper, "param_names", None) or getattr(getattr(wrapper, "deepspeed", None),
                                                                  "param_names", None) or {}
        self._engine = dict(zip(map(id, engine), own_names((name, p) for p, name in engine.items())))
        self._born, self._known = born, known
        kind = type(wrapper).__name__
        self._flats = {"FP16_UnfusedOptimizer": _unfused, "FP16_Optimizer": _fused, "BF16_Optimizer": _bf16,
                       "DeepSpeedZeroOptimizer": _zero12, "DeepSpeedZeroOptimizer_Stage3": _zero3}[kind]

    def groups(self) -> list[tuple[dict[str, Any], list[Held]]]:
        """Per flat tensor, in the order the wrapper steps them, its param group (with the model's
        names as ``param_names``) and the fragments it holds."""
        out = []
        for group, fragments in self._flats(self.wrapper()):
            out.append(({**group, "param_names": [self.name(h.source) for h in fragments]}, fragments))
        return out

    def optimizer(self) -> Any:
        """The optimizer as its param groups are outside the wrapper's calls: all of them (stages 1-2
        leave only the group being stepped during a call)."""
        wrapper = self.wrapper()
        assert wrapper is not None  # the wrapper holds the optimizer, which holds the monitor of this layout
        groups = _all_groups(wrapper) if type(wrapper).__name__ == "DeepSpeedZeroOptimizer" \
            else wrapper.optimizer.param_groups
        return SimpleNamespace(param_groups=groups, defaults=wrapper.optimizer.defaults)

    def last(self) -> int:
        """The id of the flat tensor the wrapper steps last in each of its steps."""
        return id(self._flats(self.wrapper())[-1][1][-1].param)

    def name(self, p: Tensor | None) -> str:
        """The name of the model's parameter ``p`` (see the class docstring)."""
        born = self._born.get(id(p), "param")
        if is_unnamed(born):
            return self._known.get(id(p)) or self._engine.get(id(p)) or born
        return born


def _fragments(flat: Tensor, sources: list[Tensor], spans: list[tuple[int, int]], shards: int | None
               ) -> list[Held]:
    """The fragments of ``flat``: per model parameter its ``(start in flat, numel)`` (where in the
    parameter they lie does not matter to moments); a fragment that is all of its parameter is
    shaped like it."""
    out = []
    base = flat.detach().reshape(-1)
    for source, (start, numel) in zip(sources, spans):
        shape = whole_shape(source)
        whole = numel == shape.numel()
        local = base[start:start + numel]
        out.append(Held(local.view(shape) if whole else local, flat, shards, span=(start, numel),
                        split=0 < numel and not whole, source=source))
    return out


def _unfused(w: Any) -> list[tuple[dict[str, Any], list[Held]]]:
    """Stage 0, bf16/fp16 with a torch optimizer: one fp32 copy per parameter, on every rank."""
    return [(group, [Held(copy, copy, 1, source=lp) for copy, lp in zip(fp32, lps)])
            for group, fp32, lps in zip(w.optimizer.param_groups, w.fp32_groups, w.fp16_groups)]


def _fused(w: Any) -> list[tuple[dict[str, Any], list[Held]]]:
    """Stage 0, fp16 with a fused optimizer: one flat fp32 copy per group, on every rank."""
    out = []
    for group, flat, lps in zip(w.optimizer.param_groups, w.fp32_groups_flat, w.fp16_groups):
        starts = [sum(p.numel() for p in lps[:i]) for i in range(len(lps))]
        out.append((group, _fragments(flat, lps, [(s, p.numel()) for s, p in zip(starts, lps)], 1)))
    return out


def _mapped(groups: list[dict[str, Any]], flats: list[Tensor], lp_groups: list[list[Tensor]]
            ) -> list[tuple[dict[str, Any], list[Held]]]:
    """Stages 1-2 and BF16: each parameter's ``_hp_mapping`` gives its fragment of this rank's partition."""
    out = []
    for group, flat, lps in zip(groups, flats, lp_groups):
        spans = []
        for lp in lps:
            m = getattr(lp, "_hp_mapping", None)
            spans.append((0, 0) if m is None else (m.hp_fragment_address.start, m.hp_fragment_address.numel))
        out.append((group, _fragments(flat, lps, spans, None)))
    return out


def _bf16(w: Any) -> list[tuple[dict[str, Any], list[Held]]]:
    return _mapped(w.optimizer.param_groups, w.fp32_groups_flat_partition, w.bf16_groups)


def _zero12(w: Any) -> list[tuple[dict[str, Any], list[Held]]]:
    return _mapped(_all_groups(w), w.single_partition_of_fp32_groups, w.bit16_groups)


def _all_groups(w: Any) -> list[dict[str, Any]]:
    """The optimizer's param groups, all of them: stages 1-2 leave only the group being stepped in
    ``param_groups`` during ``_optimizer_step``, which holds the whole list as ``original_param_groups``."""
    groups = w.optimizer.param_groups
    frame: FrameType | None = sys._getframe(1)
    while len(groups) < len(w.single_partition_of_fp32_groups) and frame is not None:
        if frame.f_locals.get("self") is w and "original_param_groups" in frame.f_locals:
            groups = frame.f_locals["original_param_groups"]
        frame = frame.f_back
    return groups


def _zero3(w: Any) -> list[tuple[dict[str, Any], list[Held]]]:
    """Stage 3: each parameter is cut into equal partitions (the last padded); a sub-group's flat
    tensor is this rank's partition of each of its parameters, end to end."""
    rank = dist.get_rank(group=w.dp_process_group)
    out = []
    for k, (flat, lps) in enumerate(zip(w.fp32_partitioned_groups_flat, w.fp16_groups)):
        group = w.optimizer.param_groups[w.sub_group_to_group_id[k]]
        spans, start = [], 0
        for lp in lps:
            size = lp.partition_numel()
            first = rank * size
            spans.append((start, max(0, min(size, lp.ds_numel - first))))
            start += size
        out.append((group, _fragments(flat, lps, spans, None)))
    return out

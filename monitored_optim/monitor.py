"""The Monitor: the public ``opt.monitor``, and the flow of one ``step()``.

A step that does not log calls the base step and counts it, nothing else. A logging step runs
these stages, each a call into the module that owns it:

1. cadence: is this a logging step? (:meth:`Monitor.run`)
2. plan and capture before the step: each parameter's p_before by its route, and the sums of
   p_before and the grads (:class:`~monitored_optim.capture.Capture`, ``before``);
3. the base step, called once (its hooks fire once);
4. capture after the step: each stored change u and its sums (``Capture.after``);
5. reduce: one device-to-host copy, or under ``torch.distributed`` one all_reduce
   (:func:`monitored_optim.reduce.gather`, :mod:`monitored_optim.distributed`);
6. figures (:class:`~monitored_optim.figures.Figures`), then the capture rules' memories for the
   next logging step (``Capture.remember``);
7. deliver: ``latest``, the history, ``params.json`` and the backends, on the writing rank
   (:class:`monitored_optim.deliver.Delivery`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import amp, backends, distributed, engine, families, histograms, pieces, reduce, stats, usage
from ._warnings import Once
from .alerts import Voice
from .capture import Capture, closure_is_first, closure_of, with_grads_of_closure
from .capture.plan import Entries, born, names
from .capture.spent import stage
from .config import MonitorConfig, Settings, resolve
from .count import StepCount
from .deliver import Delivery
from .figures import Figures, group_lrs, tensor_lrs
from .guard import Guard, ran_first
from .health import Health
from .models import Models
from .readback import ReadBack
from .updates import View, view_for
from .updates.view import bind
from .workspace import Workspace


class Monitor(ReadBack):
    """Counts optimizer steps and, every ``every`` steps, measures and logs each parameter's update.

    Reached as ``opt.monitor`` on a ``Monitored(...)`` optimizer; users do not build it.

    Attributes:
        step: optimizer steps completed (int; the first ``step()`` makes it 1; AMP-skipped steps
            count only with ``MonitorConfig(count="calls")``), the x axis of every figure. May be set
            (an int >= 0) to continue a checkpoint's axis; below a logged step that warns once.
        latest: ``dict[str, float]``, tag -> value of the last logging step (empty before it).
        settings: the checked :class:`~monitored_optim.config.Settings`.
        health: the :class:`~monitored_optim.health.Health` tracker (``health.skipped_steps``).

    Raises:
        ValueError, TypeError: from :func:`~monitored_optim.config.resolve` for bad configuration;
        ImportError: a requested backend's package is not installed;
        OSError: the log directory of a file backend cannot be created.
    """

    def __init__(self, config: MonitorConfig | None, optimizer_cls: type[torch.optim.Optimizer]) -> None:
        self.config = config
        self.settings: Settings = resolve(config)
        backends.check_installed(self.settings.backends)
        self.view: View = view_for(optimizer_cls)
        self._closure_first = closure_is_first(optimizer_cls)
        self._count = StepCount()
        self._told = Once()  # unnamed and unmapped parameters
        self.base_calls = 0
        chosen = families.build(self.settings.figures)
        self._keys = pieces.keys(chosen)  # every piece key and its reduction: the sharded table's rows
        self.capture = Capture(self.view, self.settings, chosen, self._keys.heads)
        self._delivery = Delivery(self.settings)
        self.voice = Voice(self._delivery.writes, self.settings.alerts, self.settings.stop_on, self._delivery.alert)
        families.speak(chosen, self.voice)  # warnings and events where the figures are written
        self.health = Health(self.voice)
        self.guard = Guard(self.settings.guard, self.settings.skip_budget, self.voice) if self.settings.guard else None
        self._guarded: tuple[tuple[int, ...], list[tuple[str, torch.Tensor]]] = ((), [])  # the params it judges
        self._figures = Figures(self.settings, chosen, self.health, self.capture.held)  # no cycle through self
        self._optimizer: Callable[[], torch.optim.Optimizer | None] = lambda: None
        self._ranks = distributed.Ranks()  # the names every rank monitors, once exchanged
        self._search = engine.Search()  # the layout: one optimizer alone, until DeepSpeed's wrapper is found
        self._usage = usage.Usage(optimizer_cls.__name__)
        self._models = Models()  # the names of parameters after the models, and the models watched
        weakref.finalize(self, self._delivery.close)  # a monitor collected unclosed closes its files
        amp.install()

    @property
    def step(self) -> int:
        """Optimizer steps completed: the x axis of every logged figure (see the class docstring)."""
        return self._count.step

    @step.setter
    def step(self, value: int) -> None:
        self._count.set(value)

    def resume_at(self, step: int) -> None:
        """Continue the count from ``step``, a loaded checkpoint's, quietly (a rollback included: what
        was logged after ``step`` is superseded); setting :attr:`step` below a logged step warns instead.

        Raises:
            ValueError: ``step`` is not an integer >= 0.
        """
        self._count.resume_at(step)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the guard (``MonitorConfig.guard``) skipped the last ``step()`` (False without it)."""
        return self.guard is not None and self.guard.last_skipped

    @property
    def should_stop(self) -> bool:
        """Whether an event asked to stop (``MonitorConfig.stop_on``, or the guard past its
        ``skip_budget``): True on every rank from the same step on."""
        return self.voice.should_stop

    def acting_state(self) -> dict[str, Any]:
        """What the guard and the alerts keep across steps (the guard's counts and spike history, the
        alerts' clocks), for a checkpoint; empty with both off."""
        state: dict[str, Any] = {"guard": self.guard.state_dict()} if self.guard is not None else {}
        if self.settings.alerts:
            state["alerts"] = self.voice.state_dict()
        return state

    def load_acting_state(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`acting_state` gave (a part for what is off here is left aside)."""
        if self.guard is not None and isinstance(state.get("guard"), dict):
            self.guard.load_state_dict(state["guard"])
        if isinstance(state.get("alerts"), dict):
            self.voice.load_state_dict(state["alerts"])

    def skipped(self) -> None:
        """Count a step that an AMP GradScaler skipped (``health/skipped_steps``, and the step itself
        when ``count="calls"``)."""
        self.health.skipped_steps += 1
        if self.settings.count == "calls":
            self._count.step += 1

    def attach(self, optimizer: torch.optim.Optimizer, wrapper: Any = None,
               model: torch.nn.Module | None = None) -> None:
        """Bind to the optimizer once it is built: bind the view to it, watch ``config.model``, name
        parameters after ``model`` too (one of several optimizers of a model, a DeepSpeed engine's),
        warn about unnamed parameters, find matrices the snapshot rule takes from the first logging
        step. ``wrapper``: the DeepSpeed wrapper that steps it, where already known
        (:func:`~monitored_optim.attach.attach` to an engine), which then counts its steps."""
        self._optimizer = weakref.ref(optimizer)
        self._usage.built = True
        self.view = bind(self.view, optimizer)
        self.capture.use(self.view)
        watched = self.config.model if self.config is not None else None
        for m in (m for m in (watched, model) if m is not None):
            self._models.name_after(m)
        told = self._told if wrapper is None else None  # DeepSpeed's flat buffers are named by its layout
        every, chosen = born(optimizer, self._models.names, self.settings.select, told)
        self._search.born = {id(p): n for n, p in every}
        self.capture.risk.mark_when_built(chosen)
        if wrapper is not None:
            if self.guard is not None:
                raise ValueError(NO_GUARD_UNDER_DEEPSPEED)
            self._search.layout = engine.EngineSteps(self, optimizer, wrapper, inside=False)
        if watched is not None:
            self.watch(watched)

    def watch(self, model: torch.nn.Module) -> list[str]:
        """Name the optimizer's parameters after ``model``'s, and warn about those it does not hold.

        Parameters that param groups hold without names get the names the plain model inside
        ``model``'s wrappers gives them (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.`` left
        out: :func:`~monitored_optim.models.own_named_parameters`; a tied weight its first name);
        each trainable parameter of ``model`` that no param group holds is warned about once.

        Checked now and again at every logging step (param groups can be added later).

        Returns:
            The names of the trainable parameters of ``model`` missing from the optimizer now.

        Raises:
            TypeError: ``model`` is not a ``torch.nn.Module``.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch() expects a torch.nn.Module, got {type(model).__name__}")
        self._models.watch(model)
        optimizer, layout = self._optimizer(), self._search.layout
        return [] if optimizer is None else self.health.check_watched(model, layout.model_params(optimizer))

    def run(self, optimizer: torch.optim.Optimizer, step_fn: Callable[..., Any],
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``step_fn(optimizer, *args, **kwargs)`` (the unhooked base step) once and monitor it.

        Under ``torch.compile(opt.step)`` a non-logging step traces to the plain optimizer's graph;
        a logging step runs the capture before and after the base step outside the compiled graphs
        (``torch.compiler.disable``), while the base step itself stays compiled, so the trajectory
        is the plain compiled optimizer's.

        Returns what the base step returns (the closure's loss, if any).
        """
        if not self._usage.stepped:
            self._usage.stepped = usage.ANY.stepped = True
        layout = self._search.layout_of(self, optimizer)
        if isinstance(layout, engine.EngineSteps):
            if self.guard is not None:
                raise ValueError(NO_GUARD_UNDER_DEEPSPEED)
            return layout.call(optimizer, step_fn, args, kwargs)
        self.base_calls += 1
        if amp.skips(optimizer):  # a fused optimizer under GradScaler
            self.skipped()
            return step_fn(optimizer, *args, **kwargs)
        if self.guard is not None:
            args, kwargs, loss = ran_first(args, kwargs, self._closure_first)
            if self._guard_skips(optimizer):
                return loss
        pending = self.begin(optimizer)
        out, _ = self.part(optimizer, pending, step_fn, args, kwargs)
        self.end(optimizer, pending)
        return out

    def _guard_skips(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the guard skips this step (counted as a step under ``count="calls"``)."""
        assert self.guard is not None  # run() asks only with the guard on
        key = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
        if key != self._guarded[0]:  # param groups changed: name and choose again
            every = [(n, p) for group, own in zip(optimizer.param_groups, names(optimizer, self._models.names))
                     for n, p in zip(own, group["params"])]
            self._guarded = key, [(n, p) for n, p in every if self.settings.select(n, p)]
        named = [(n, p.grad) for n, p in self._guarded[1] if p.grad is not None]
        if not self.guard.skips(named, getattr(optimizer, "grad_scale", None), self.step + 1):
            return False
        if self.settings.count == "calls":
            self._count.step += 1
        return True

    def begin(self, optimizer: torch.optim.Optimizer, layout: Any = None) -> Pending | None:
        """Begin a step: on a logging step, its sharding (None outside torch.distributed; ``layout``:
        DeepSpeed's) and its batch of sums; None on another step."""
        return self._open(optimizer, layout) if self._count.logs_next(self.settings.every) else None

    @torch.compiler.disable
    def _open(self, optimizer: torch.optim.Optimizer, layout: Any) -> Pending:
        return Pending(optimizer, distributed.sharding(optimizer, layout), stats.Batch(Workspace()))

    def part(self, optimizer: torch.optim.Optimizer, pending: Pending | None, step_fn: Callable[..., Any],
             args: tuple[Any, ...], kwargs: dict[str, Any], groups: set[int] | None = None
             ) -> tuple[Any, Entries | None]:
        """Call the base step ``step_fn(optimizer, *args, **kwargs)`` once, within the step ``pending``
        begun: on a logging step, captured before and after (the param groups ``groups``, None: all).
        Returns what the base step returns, and the entries captured (None on another step)."""
        if pending is None:
            return step_fn(optimizer, *args, **kwargs), None
        made, args, kwargs = self._before(pending, args, kwargs, groups)
        with self.view.stepping():  # a view that measures each parameter in its turn of the step
            out = step_fn(optimizer, *args, **kwargs)
        self._after(pending, made)
        return out, made

    def end(self, optimizer: torch.optim.Optimizer, pending: Pending | None, stepped: bool = True) -> None:
        """End the step that ``pending`` began: count it (a step that stepped nothing as skipped) and, on a
        logging step, reduce, compute the figures and deliver them."""
        if not stepped:
            self.skipped()
        elif pending is None:
            self._count.step += 1
        else:
            self._finish(pending)

    @stage()
    def _before(self, pending: Pending, args: tuple[Any, ...], kwargs: dict[str, Any],
                groups: set[int] | None = None) -> tuple[Entries, tuple[Any, ...], dict[str, Any]]:
        """Stage 2: the capture before a base step (of the param groups ``groups``, None: all); returns
        the entries it made and the step's arguments, a closure wrapped to record the grads it makes."""
        sharding = pending.sharding
        self._search.layout.tell_unmapped(pending.read, self._told)
        grad_scale = getattr(pending.optimizer, "grad_scale", None)
        fuse = self.capture.may_fuse(sharding.sharded, grad_scale, closure_of(args, kwargs, self._closure_first))
        entries = self.capture.before(pending.read, pending.batch, grad_scale,
                                      self._models.names, split=not sharding.sharded, fuse=fuse,
                                      cloned=sharding.cloned(self.view), groups=groups)
        pending.entries.extend(entries)
        return (entries, *with_grads_of_closure(entries.all, pending.batch, args, kwargs, self._closure_first,
                                                self.capture.eager.grads))

    @stage()
    def _after(self, pending: Pending, entries: Entries) -> None:
        """Stage 4: the capture after a base step, of the ``entries`` taken before it."""
        self.capture.after(pending.read.state, entries, pending.batch)

    @stage(last=True)
    def _finish(self, pending: Pending) -> None:
        """Stages 5 to 7: count the step, reduce, compute the figures, deliver."""
        self._count.step += 1
        sharding, entries = pending.sharding, pending.entries
        self.capture.finish(entries)
        roster = self.capture.roster(entries, sharding.shape)
        optimizer = pending.optimizer
        source = self._search.layout.source(optimizer)
        lr_values = tensor_lrs(source)
        hosted, read_lrs, reduced = reduce.gather(entries, roster, pending.batch.finish(), lr_values, sharding,
                                                self._keys, self._ranks, self.capture.spent.so_far())
        lrs = group_lrs(source.param_groups, dict(zip(lr_values, read_lrs)))
        groups = pending.read.param_groups
        everyone = roster if reduced is None else roster.joined(reduced.remote, reduced.names)
        local = self._search.layout.local_lrs(groups)
        figures = self._figures.compute(self.step, everyone, hosted, source, lrs, groups, local)
        self.capture.remember(roster, hosted if everyone is roster else hosted.head(len(roster.names)))
        figures.update(self.capture.spent.figures(self.settings.figures, None if reduced is None else reduced.cost))
        if self.guard is not None:
            figures["guard/skipped"] = float(self.guard.skipped)
        self._count.logged = self.step
        self._delivery.send(self.step, figures, everyone, histograms.of(everyone.names, hosted.pieces))
        for model in self._models.watched():
            self.health.check_watched(model, self._search.layout.model_params(optimizer))

    def close(self) -> None:
        """Flush and close the backends, let go of the parameters held (idempotent; the backends of a monitor
        not closed are closed at exit)."""
        self.capture.release()
        self._delivery.close()
        usage.tell_unstepped([self._usage])


NO_GUARD_UNDER_DEEPSPEED = (
    "MonitorConfig.guard cannot skip a DeepSpeed engine's steps: DeepSpeed steps its flat buffers itself, "
    "one param group after another, and no base step may be left out of one of them; use DeepSpeed's own "
    "means (fp16 dynamic loss scaling skips a step whose grads overflow), and keep MonitorConfig(alerts=..., "
    "stop_on=...) to hear of a NaN and stop")
"""Why the guard refuses a DeepSpeed engine."""


class Pending:
    """A logging step in progress: the optimizer stepped, its layout (:class:`~monitored_optim.distributed.Sharding`,
    or :class:`~monitored_optim.distributed.Unsharded` outside torch.distributed), its batch of sums and
    the entries captured so far."""

    __slots__ = ("optimizer", "sharding", "batch", "entries")

    def __init__(self, optimizer: torch.optim.Optimizer, sharding: distributed.Sharding | distributed.Unsharded,
                 batch: stats.Batch) -> None:
        self.optimizer, self.sharding, self.batch, self.entries = optimizer, sharding, batch, Entries()

    @property
    def read(self) -> Any:
        """The optimizer whose param groups and state the capture reads (the sharding's ``local`` one)."""
        return self.sharding.local

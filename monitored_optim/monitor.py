"""The Monitor: step counting, the capture around the base step, the figures and their delivery.

Flow of one ``step()`` (the project's design notes, ``shared/DESIGN.md``): a non-logging step calls the base step and counts it,
nothing else. A logging step reduces p_before and the grad to moments, lets the update view
snapshot what it needs, calls the base step once, rebuilds each update u, reduces it to moments,
copies everything to the host at once, derives the figures and the health counts and hands them
to the backends.
"""

from __future__ import annotations

import atexit
import functools
import gc
import inspect
import math
import weakref
from collections.abc import Callable, Iterator
from itertools import compress
from typing import Any

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors

from . import amp, capture, distributed, families, fused, grouping, pieces, stats
from .layout import Entries, Entry, Flat, Layout, Roster, composition, fingerprint, names as _names
from ._warnings import warn
from .backends import Fanout
from .config import MonitorConfig, Settings, every_parameter, resolve
from .health import Checks, Health
from .history import History
from .tags import DEFAULT_FAMILIES, family
from .updates import CLONE, Cloned, Rows, View, elementwise, raw_step, rebuild, view_for
from .families.base import Family

VERIFY_RTOL = 1e-3
"""Verify mode's tolerance, relative to the update itself: ``||excess|| <= VERIFY_RTOL * ||u_clone||``
(:func:`~monitored_optim.capture.verify_miss`)."""


def _gc_paused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with Python's cyclic garbage collector paused (and resumed after, if it was on).

    A logging step allocates a few Python objects per parameter (its entries, rows and figures),
    most freed by reference counting when it returns; without the pause those allocations trigger
    collections that scan the whole training process's heap in the middle of the step (measured on
    2,000 small tensors: a logging step 4.1x the plain step with them, 2.6x without)."""
    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        was_on = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()
    return paused


class Monitor:
    """Counts optimizer steps and, every ``every`` steps, measures and logs each parameter's update.

    Reached as ``opt.monitor`` on a ``Monitored(...)`` optimizer; users do not build it.

    Attributes:
        step: optimizer steps completed (int; the first ``step()`` makes it 1; AMP-skipped steps
            count only with ``MonitorConfig(count="calls")``). The x axis of every logged figure.
            May be set (an int >= 0), to continue the axis of a checkpoint that has no step count;
            setting it below a step already logged warns once. Loading a state dict of the monitored
            class continues its saved count quietly (:meth:`resume_at`), a rollback included.
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
        _check_installed(self.settings.backends)
        if distributed.is_writer():  # other ranks never write: no stray (differently timestamped) dirs
            _make_logdir(self.settings)
        self.view: View = view_for(optimizer_cls)
        self._closure_first = _closure_is_first(optimizer_cls)
        self._step = 0
        self._logged = 0
        self._told_back = False
        self._told_budget = False
        self._described: tuple[str, ...] = ()
        self._tag_names: tuple[str, ...] = ()  # the names of _tag_list: every _tags of each, in order
        self._tag_list: list[str] = []
        self._families = families.build(self.settings.figures)
        self._reductions = pieces.declared(self._families)  # head of each piece key -> its reduction
        self._piece_keys = {**pieces.CORE, **{key: how for fam in self._families for key, how in fam.pieces.items()}}
        self._told_left_out: set[str] = set()
        self.base_calls = 0
        self.latest: dict[str, float] = {}
        self.health = Health()
        self._history = History()
        self._backends = Fanout(self.settings.backends, self.settings.logdir, self.settings.strict, self.settings.sinks)
        self._optimizer: Callable[[], torch.optim.Optimizer | None] = lambda: None
        self._watched: list[weakref.ref[torch.nn.Module]] = []
        self._model_names: dict[int, str] = {}
        self._warned_unnamed = False
        self._verify_told: set[str] = set()
        self._centring = stats.CentringMemory()
        self._risk = capture.RiskMemory()
        self._budget = capture.PART_ELEMENTS * 4
        self._layout: Layout | None = None
        self._roster: Roster | None = None
        self._fuser = fused.Fuser(self.settings.compile)
        _warn_if_shared(self.settings)
        _ALL.add(self)
        amp.install()

    @property
    def step(self) -> int:
        """Optimizer steps completed: the x axis of every logged figure (see the class docstring)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if _valid_step(value) < self._logged and not self._told_back:
            self._told_back = True
            warn(f"monitored_optim: the monitor's step moves back from {self._step} to {value}, below step "
                 f"{self._logged} that it already logged, so figures will be logged again at steps already "
                 "used; set opt.monitor.step to the step your checkpoint was saved at", RuntimeWarning)
        self._step = value

    def resume_at(self, step: int) -> None:
        """Continue the count from ``step``, the count a loaded checkpoint saved, without a warning.

        Loading a checkpoint is deliberate and its count is right, so a rollback to it (saved at step
        5, trained to 10, loaded) goes back quietly; what was logged after ``step`` is superseded.
        Setting :attr:`step` by hand below a logged step warns instead.

        Raises:
            ValueError: ``step`` is not an integer >= 0.
        """
        self._step = _valid_step(step)
        self._logged = min(self._logged, step)

    def skipped(self) -> None:
        """Count a step that an AMP GradScaler skipped (``health/skipped_steps``, and the step itself
        when ``count="calls"``)."""
        self.health.skipped_steps += 1
        if self.settings.count == "calls":
            self._step += 1

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Bind to the optimizer once it is built: watch ``config.model``, warn about unnamed
        parameters, find matrices the snapshot rule takes from the first logging step."""
        self._optimizer = weakref.ref(optimizer)
        if self.config is not None and self.config.model is not None:
            self.watch(self.config.model)
        known = self._model_names
        if not self._warned_unnamed and any(not g.get("param_names") and any(id(p) not in known for p in g["params"])
                                            for g in optimizer.param_groups):
            self._warned_unnamed = True
            warn("monitored_optim: the optimizer's parameters have no names, so figures are logged as "
                 "param0, param1, ...; pass model.named_parameters() (or param groups whose 'params' are "
                 "(name, tensor) pairs), or MonitorConfig(model=model), to log them by name")
        every = [(n, p) for group, names in zip(optimizer.param_groups, _names(optimizer, known))
                 for n, p in zip(names, group["params"])]
        chosen = [(n, p) for n, p in every if self.settings.select(n, p)]
        if every and not chosen:
            warn(f"monitored_optim: the parameter selection (MonitorConfig params=/exclude= or MONITORED_OPTIM_PARAMS) "
                 f"matches none of the {len(every)} parameters, so nothing is monitored; their names look like "
                 f"{every[0][0]!r}", RuntimeWarning)
        self._risk.mark_when_built(chosen)

    def watch(self, model: torch.nn.Module) -> list[str]:
        """Warn once about each trainable parameter of ``model`` that no param group holds, and
        name the parameters that param groups hold without names as ``model.named_parameters()``
        does (a tied weight under its first name).

        Checked now and again at every logging step (param groups can be added later).

        Returns:
            The names of the trainable parameters of ``model`` missing from the optimizer now.

        Raises:
            TypeError: ``model`` is not a ``torch.nn.Module``.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch() expects a torch.nn.Module, got {type(model).__name__}")
        self._watched.append(weakref.ref(model))
        for name, p in model.named_parameters():
            self._model_names.setdefault(id(p), name)
        optimizer = self._optimizer()
        return self.health.check_watched(model, optimizer) if optimizer is not None else []

    def describe(self) -> str:
        """What will be measured, for ``print``: the param groups and their hyperparameters, then
        each parameter's name, shape, dtype, kind and how it is captured and why
        (:func:`monitored_optim.describe.describe`).

        Raises:
            RuntimeError: the optimizer this monitor belongs to no longer exists.
        """
        from .describe import describe

        optimizer = self._optimizer()
        if optimizer is None:
            raise RuntimeError("monitored_optim: the optimizer of this monitor no longer exists")
        return describe(self, optimizer, _names(optimizer, self._model_names))

    def history(self) -> Any:
        """The figures of the logging steps kept in memory, as a pandas ``DataFrame``: one row per
        logging step (index ``step``), one float32 column per tag, NaN where a step did not log it.

        Bounded (:mod:`monitored_optim.history`): at most 4,194,304 values (16 MiB) in rows evenly
        spaced over the whole run, and the last logging step.

        Raises:
            ImportError: pandas is not installed (``pip install 'monitored_optim[notebook]'``).
        """
        return self._history.frame()

    def plot(self, params: str | None = None) -> Any:
        """The report's update-to-data figure of this run, from memory, as a matplotlib ``Figure``
        (shown inline by Jupyter; ``fig.savefig("u.png")`` writes it):
        :func:`monitored_optim.report.draw_run`, ``params`` a glob on parameter names.

        Raises:
            ReportError: nothing logged yet, matplotlib is missing, or ``params`` matches no parameter.
        """
        from .report.plot import draw_run

        return draw_run(self._run(), params=params)

    def report(self, last: int = 20) -> Any:
        """The report table of this run, from memory: a :class:`monitored_optim.report.Summary` (medians
        over the ``last`` logging steps), which Jupyter renders as the table and ``print`` as text.

        Raises:
            ReportError: nothing logged yet.
        """
        from .report.summary import summarize

        return summarize(self._run(), last)

    def _run(self) -> Any:
        """The history as the report's ``Run``, named after the optimizer's class, its parameters' kinds
        from their shapes."""
        from pathlib import Path

        from .describe import kind

        optimizer = self._optimizer()
        groups = [] if optimizer is None else zip(optimizer.param_groups, _names(optimizer, self._model_names))
        kinds = {self.settings.prefix + n: kind(p) for group, names in groups for n, p in zip(names, group["params"])}
        return self._history.run(Path(self.settings.prefix + type(optimizer).__name__), kinds)

    def run(self, optimizer: torch.optim.Optimizer, step_fn: Callable[..., Any],
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``step_fn(optimizer, *args, **kwargs)`` (the unhooked base step) once and monitor it.

        Under ``torch.compile(opt.step)`` a non-logging step traces to the plain optimizer's graph;
        a logging step runs the capture before and after the base step outside the compiled graphs
        (``torch.compiler.disable``), while the base step itself stays compiled, so the trajectory
        is the plain compiled optimizer's.

        Returns what the base step returns (the closure's loss, if any).
        """
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf is not None and bool(found_inf):  # a fused optimizer under GradScaler, skipped
            self.base_calls += 1
            self.skipped()
            return step_fn(optimizer, *args, **kwargs)
        if (self._step + 1) % self.settings.every:
            self.base_calls += 1
            out = step_fn(optimizer, *args, **kwargs)
            self._step += 1
            return out
        entries, batch, sharding, args, kwargs = self._prepare(optimizer, args, kwargs)
        self.base_calls += 1
        out = step_fn(optimizer, *args, **kwargs)
        self._finish(optimizer, entries, batch, sharding)
        return out

    @torch.compiler.disable
    @_gc_paused
    def _prepare(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[Entries, stats.Batch, distributed.Sharding | None, tuple[Any, ...], dict[str, Any]]:
        """Before the base step of a logging step: the entries, their snapshots and the sums of
        p_before and the grads (a closure's, where the step takes one)."""
        sharding = distributed.sharding(optimizer)  # None outside torch.distributed
        batch = stats.Batch(capture.Workspace())  # its buffers go with the batch at the end of the step
        grad_scale = getattr(optimizer, "grad_scale", None)
        fuse = (sharding is None and grad_scale is None and not self.settings.verify
                and not _closure(args, kwargs, self._closure_first)
                and all(type(fam).part is Family.part for fam in self._families))
        entries = self._before(optimizer if sharding is None else sharding.local, batch,
                               grad_scale, split=sharding is None, fuse=fuse)
        if sharding is not None:  # views that are not element-wise cannot rebuild a shard's update
            sharding.clone_where_needed(entries.all, self.view)
        args, kwargs = _record_grads_after_closure(entries.all, batch, args, kwargs, self._closure_first)
        return entries, batch, sharding, args, kwargs

    @torch.compiler.disable
    @_gc_paused
    def _finish(self, optimizer: torch.optim.Optimizer, entries: Entries, batch: stats.Batch,
                sharding: distributed.Sharding | None) -> None:
        """After the base step of a logging step: count it, then measure and deliver its figures."""
        self._step += 1
        self._log(self._figures(optimizer, entries, batch, sharding))

    def close(self) -> None:
        """Flush and close every backend and let go of the parameters the layout holds (idempotent; also
        run at interpreter exit)."""
        self._layout = self._roster = None
        self._backends.close()
        _OPEN.discard(self)
        _ALL.discard(self)  # a monitor resumed into the same logdir after this one is no clash

    @torch.no_grad()
    def _before(self, optimizer: torch.optim.Optimizer, batch: stats.Batch,
                grad_scale: Tensor | None, split: bool = True, fuse: bool = False) -> Entries:
        """An entry per part of each monitored parameter, with its snapshot, and the sums of p_before
        and the grad in ``batch`` (``split``: large parameters may be cut into parts; ``fuse``: the
        fused capture may take whole parameters: their p_before is copied, flat or not, or reduced
        here with its bounds, and their grads are reduced after the step)."""
        entries, leads, unflat, blocks, copies = [], [], [], [], []
        layout = self._layout_of(optimizer, fuse)
        cut = split and elementwise(self.view)
        self._budget = batch.work.nbytes = layout.budget  # the batch's buffers: one chunk's temporaries
        for group, way, items in layout.groups:
            for item in items:
                if isinstance(item, list):  # a run of flat entries: copied into their chunks' buffers, no part
                    entries += item
                    blocks.append(item)
                    continue
                name, p, kind = item
                if not (p.is_floating_point() or p.is_complex()):
                    continue  # integer tensors (frozen quantized weights) are never stepped
                kind = kind if kind != "whole" or _dense_grad(p) else None
                reason = capture.snapshot_reason(p, id(p) in layout.shared, name in self._risk)
                if kind == "whole" and reason is not None:  # the snapshot rule's copy, taken compiled
                    made = [Entry(name, group, p, None, fused=True)]
                    copies += made
                elif kind == "whole" and way == "rebuild":  # the view's fused form, its sums after the step
                    made = [self._entry(name, group, capture.Part(p, optimizer.state.get(p, {}), p), None, None, True)]
                else:
                    made, lead = [], None
                    for part in capture.parts(p, optimizer.state.get(p, {}), cut, self._budget // p.element_size()):
                        made.append(self._entry(name, group, part, reason, lead, work=batch.work))
                        lead = lead or made[-1]
                entries += made
                unflat += made
                blocks.append(made[0])
        for block in blocks:  # leads in order: runs of flat entries, and the first part of each other
            leads += block if isinstance(block, list) else [block]
        _assign_slots(blocks, batch.slots(len(stats.KINDS) * len(leads)).start)
        befores = [fused.flat_copy(chunk.params) for chunk in layout.chunks]
        for chunk in _device_chunks(copies):  # the snapshot rule's copies of fused entries
            for e, before in zip(chunk, self._fuser(fused.copied, [e.p for e in chunk], device=chunk[0].p.device)):
                e.snapshot = Cloned(before)
        rebuilt = [e for e in unflat if e.fused and e.snapshot is None]
        for chunk in _device_chunks(rebuilt):  # the bounds and p_before's sums of those the view rebuilds
            rows = self._fuser(fused.prior, [e.p for e in chunk], device=chunk[0].p.device)
            batch.put(rows[:, 2:5], [stats.count(e.p) for e in chunk], [e.slots["p"] for e in chunk])
            for e, extremes, exact in zip(chunk, rows[:, :2].unbind(), rows[:, 5:].unbind()):
                e.extremes = extremes
                e.pieces["exact"] = exact
        eager = [e for e in unflat if not e.fused]
        _record(batch, eager, "p", [e.p for e in eager], self._centred(eager, "p"))
        if self.settings.figures & {"grad_to_data", "norms", "health"}:
            _record_grads(batch, eager, grad_scale, self._centred(eager, "grad"))
        return Entries(entries, leads, unflat, befores)

    def _layout_of(self, optimizer: torch.optim.Optimizer, fuse: bool) -> Layout:
        """This logging step's :class:`~monitored_optim.layout.Layout`: the last one where its
        :func:`~monitored_optim.layout.fingerprint` and the selection (a ``MonitorConfig(params=...)``
        callable is asked again at every logging step) are the same, else a new one."""
        ways = tuple(self._fusion(group) if fuse else None for group in optimizer.param_groups)
        key = fingerprint(optimizer, (ways, len(self._model_names)))
        held = self._layout if self._layout is not None and self._layout.key == key else None
        names = held.names if held is not None else _names(optimizer, self._model_names)
        select = self.settings.select
        mask = None if select is every_parameter else [select(n, p) for group, own in zip(optimizer.param_groups, names)
                                                       for n, p in zip(own, group["params"])]
        if held is not None and held.mask == mask:
            return held
        chosen = iter(mask) if mask is not None else None
        groups, flat, params = [], [], []
        for group, way, own in zip(optimizer.param_groups, ways, names):
            items: list[Any] = []  # runs of flat entries (lists) and the other parameters (name, p, kind)
            for name, p in zip(own, group["params"]):
                if chosen is not None and not next(chosen):
                    continue
                params.append(p)
                kind = self._fusable(p) if way is not None else None
                if kind != "flat":
                    items.append((name, p, kind))
                    continue
                flat.append(Entry(name, group, p, None, fused=True))
                if not (items and isinstance(items[-1], list)):
                    items.append([])
                items[-1].append(flat[-1])
            groups.append((group, way, items))
        self._centring.forget(e.name for e in flat)  # captured flat: exact for any spread
        self._layout = Layout(key, names, mask, groups,  # storage shared with any parameter, chosen or not
                              capture.shared(p for group in optimizer.param_groups for p in group["params"]),
                              capture.budget(sum(p.numel() * p.element_size() for p in params)), _flat_chunks(flat))
        return self._layout

    def _fusion(self, group: dict[str, Any]) -> str | None:
        """What the fused capture may do for ``group`` on this logging step: None (nothing: an
        optimizer of unknown code, or a step that rewrites ``p.grad``, whose sums must then be taken
        before it), ``"copy"`` (flat small parameters, and snapshots where compiling is enabled) or
        ``"rebuild"`` (also the view's fused form, ``updates``' ``fused``)."""
        if self.view is CLONE or not getattr(self.view, "keeps_grad", lambda g: True)(group):
            return None
        fusable = getattr(self.view, "fusable", None)
        return "rebuild" if fusable is not None and fusable(group) else "copy"

    def _fusable(self, p: Tensor) -> str | None:
        """Whether the fused capture may take ``p`` where its group's :meth:`_fusion` allows it, from
        its metadata alone (a :class:`~monitored_optim.layout.Layout`'s input): a non-empty dense
        float32/float64 parameter, either ``"flat"`` (at most :data:`~monitored_optim.fused.SMALL`
        elements, compiled or not: its p_before is copied, so it needs no grad) or ``"whole"`` (where
        compiling is enabled for its device: the snapshot rule's copy, or, where the group's way is
        ``"rebuild"``, the view's fused form; on a logging step only with a dense grad,
        :func:`_dense_grad`); None where it may not."""
        if type(p) not in (Tensor, torch.nn.Parameter) or p.dtype not in (torch.float32, torch.float64) \
                or p.layout is not torch.strided or p.numel() == 0:
            return None
        if p.numel() <= fused.SMALL:
            return "flat"
        return "whole" if fused.enabled(self.settings.compile, p.device) else None

    def _entry(self, name: str, group: dict[str, Any], part: capture.Part, reason: str | None,
               lead: Entry | None, fuse: bool = False, work: capture.Workspace | None = None) -> Entry:
        """The entry of one part: the snapshot rule's copy where ``reason`` says so (the view is
        still run where its intended update is needed: bf16/fp16 ``update_lost``, verify mode),
        else the view's own snapshot; verify mode's clone where neither holds p_before. ``fuse``:
        the fused capture takes it where the snapshot is a copy or nothing (the view's fused form)."""
        verify = self.settings.verify
        if reason is not None and not (verify or part.p.dtype in capture.LOW_PRECISION):
            return Entry(name, group, part.p, Cloned(part.p.detach().clone()), part, lead)
        e = Entry(name, group, part.p, self.view.before(group, part.p, part.state), part, lead)
        e.fused = fuse and (e.snapshot is None or isinstance(e.snapshot, Cloned))
        if e.fused:  # its bounds come from the fused capture
            return e
        if reason is not None and not isinstance(e.snapshot, Cloned):
            e.copy = part.p.detach().clone()
        if e.before is None:
            e.extremes = capture.bounds(part.p)
            exact = capture.at_powers_of_two_bound(part.p, e.extremes, work)
            if exact is not None:
                self._add_piece(e.owner, "exact", exact)
        if verify and e.before is None:
            e.clone = part.p.detach().clone()
        return e

    def _centred(self, entries: list[Entry], kind: str) -> list[bool]:
        """Per entry, whether its ``kind`` moments take the centred pass."""
        return self._centring.flags((e.name for e in entries), kind)

    @torch.no_grad()
    def _figures(self, optimizer: torch.optim.Optimizer, entries: Entries, batch: stats.Batch,
                 sharding: distributed.Sharding | None = None) -> dict[str, float]:
        state = (optimizer if sharding is None else sharding.local).state
        for chunk in _chunks([e for e in entries.unflat if not e.fused], self._budget):
            self._measure_updates(chunk, [e.part.refresh(state.get(e.part.whole, {})) for e in chunk], batch)
        self._fuse([e for e in entries.unflat if e.fused], entries.befores, state, batch)
        rows = batch.finish()
        roster = self._roster_of(entries)
        leads, names = entries.leads, roster.names
        for fam in self._families:
            done = fam.done()
            by_name = {e.name: e for e in leads} if done else {}
            for name, made in done.items():
                for key, value in made.items():
                    self._add_piece(by_name[name], key, value)
        self._describe(leads, names)
        tensor_lrs = _tensor_lrs(optimizer)
        if sharding is None:  # one host copy per device of the moments, every other piece and Tensor lrs
            holding = [i for i in roster.captured if leads[i].pieces]  # a flat entry has none
            pieces = [piece for i in holding for piece in leads[i].pieces.values()]
            index = roster.index
            pairs, present, extra = rows.host(index, pieces + list(tensor_lrs.values()))
            counts = rows.sizes[index[:, 0]]  # p_before's rows cover each parameter once
            own, read = _host_pieces(leads, holding, extra[:len(pieces)]), extra[len(pieces):]
        else:  # whole-parameter values and counts: one all_reduce, one host copy (and one for Tensor lrs)
            for e in leads:
                e.pieces.update({kind: rows[slot] for kind, slot in e.slots.items() if rows[slot] is not None})
            counts, pairs, present, own = sharding.reduce(leads, self._piece_keys)
            self._tell_left_out(sharding.left_out)
            read = stats.Moments({}, {}, 0, torch.zeros(0)).host(torch.zeros(0, dtype=torch.long),
                                                               list(tensor_lrs.values()))[2]
        hosted = stats.Hosted(_moment_table(leads, roster.captured, counts, pairs, present), own)
        table = hosted.table
        figures = self._parameter_figures(roster, hosted)  # finite already
        self._remember(roster, hosted)
        sq_norms = table.sq_norm.sum(0).tolist()
        rest = {f"global/{kind}_norm": math.sqrt(v) for kind, v in zip(("param", "grad", "update"), sq_norms)}
        errors = [_verify_error(e, *got["verify"], told=self._verify_told)
                  for e, got in zip(leads, own) if "verify" in got] if self.settings.verify else []
        lrs = _group_lrs(optimizer, dict(zip(tensor_lrs, read)))
        rest.update(_learning_rates(optimizer, lrs))
        read_groups = (optimizer if sharding is None else sharding.local).param_groups  # the entries' groups
        group_lr = {id(group): lr for group, lr in zip(read_groups, lrs)}
        if "health" in self.settings.figures:  # its counts and warnings need the grads it reduces
            rest.update(self.health.figures(_health_checks(names, table), self.step))
        if self._families:
            step = families.Step(self.step, names, table, own, list(map(group_lr.get, roster.groups)), roster.shapes)
            for fam in self._families:
                rest.update(fam.figures(step))
        figures.update((tag, value) for tag, value in rest.items() if math.isfinite(value))
        chosen = self.settings.figures
        if not chosen.issuperset(DEFAULT_FAMILIES):  # the others (state, spectral) only compute when chosen
            figures = {tag: value for tag, value in figures.items() if family(tag) in chosen}
        if errors and math.isfinite(max(errors)):
            figures["verify/max_rel_error"] = max(errors)
        for model in (ref() for ref in self._watched):
            if model is not None:
                self.health.check_watched(model, optimizer)
        return figures

    def _roster_of(self, entries: Entries) -> Roster:
        """This logging step's :class:`~monitored_optim.layout.Roster`: the last one where its layout and
        the :func:`~monitored_optim.layout.composition` of its entries not captured flat are the same,
        else a new one."""
        held, order = self._roster, composition(entries.unflat)
        if held is None or held.layout is not self._layout or held.composition != order:
            held = self._roster = Roster.of(self._layout, order, entries.leads)
        return held

    def _parameter_figures(self, roster: Roster, hosted: stats.Hosted) -> dict[str, float]:
        """Per-parameter figures from the host values: the five of :func:`_tags` (the grad's only where
        there was one, none that is undefined or not finite) and ``update_lost`` in low precision."""
        table, norm, names = hosted.table, hosted.table.norm, roster.names
        columns = torch.stack([norm[:, 0], norm[:, 2], table.log10_ratio(2, 0),
                               norm[:, 1], table.log10_ratio(1, 0)], 1)
        shown = columns.isfinite()
        shown[:, 3:] &= table.has[:, 1:2]
        if tuple(names) != self._tag_names:  # the same parameters as the last logging step: the same tags
            self._tag_names, self._tag_list = tuple(names), [tag for name in names for tag in _tags(name)]
        tags = compress(self._tag_list, shown.flatten().tolist())
        figures = dict(zip(tags, columns[shown].tolist()))
        n = table.n[:, 0].tolist()
        for i in roster.low:
            got = hosted.pieces[i]
            if "lost" in got and n[i] > 0:
                figures[f"update_lost/{names[i]}"] = got["lost"][0] / n[i]
        return figures

    def _remember(self, roster: Roster, hosted: stats.Hosted) -> None:
        """After a logging step: the centring and snapshot rules' memories for the next one."""
        table, names = hosted.table, roster.names
        self._centring.update(names, roster.captured, table)  # a flat entry has no decision
        exact = torch.full((len(names),), math.nan, dtype=torch.float64)
        measured = [i for i in roster.captured if "exact" in hosted.pieces[i]]  # a flat entry has no pieces
        exact[measured] = torch.tensor([hosted.pieces[i]["exact"][0] for i in measured], dtype=torch.float64)
        self._risk.update(names, roster.position, roster.eps, table, exact)

    def _fuse(self, entries: list[Entry], befores: list[Tensor], state: dict[Tensor, dict[str, Any]],
              batch: stats.Batch) -> None:
        """The rows of the fused capture into ``batch``: p_before, grad and u of each flat chunk of the
        layout (:func:`~monitored_optim.fused.flat`; ``befores``: their p_before) and, of ``entries``
        (the other fused ones), those of snapshotted parameters and the grad and u of rebuilt ones
        (their p_before's rows came before the step, :func:`~monitored_optim.fused.prior`); one call
        per chunk of up to :data:`~monitored_optim.fused.CHUNK` parameters of one param group,
        device, dtype, rank and kind, so that identical blocks share a graph."""
        kinds: dict[tuple[Any, ...], list[Entry]] = {}
        for e in entries:
            key = (id(e.group), e.p.device, e.p.dtype, e.p.dim(), isinstance(e.snapshot, Cloned))
            kinds.setdefault(key, []).append(e)
        for chunk, before in zip(self._layout.chunks, befores):
            grads, present = _grads(chunk.params)
            rows = fused.flat(before, _flatten_dense_tensors(chunk.params), _flatten_dense_tensors(grads),
                              chunk.lengths)  # eager: faster than compiled here
            self._put(batch, chunk.members, rows, stats.KINDS, present, chunk.sizes)
        for key, members in kinds.items():
            for i in range(0, len(members), fused.CHUNK):
                chunk = members[i:i + fused.CHUNK]
                after = [e.p for e in chunk]
                grads, present = _grads(after)
                if key[-1]:
                    rows, exact = self._fuser(fused.snapshotted, [e.snapshot.before for e in chunk], after, grads,
                                              device=key[1])
                    for e, value in zip(chunk, exact.unbind()):
                        e.pieces["exact"] = value.reshape(1)
                else:
                    rows = self._rebuilt_rows(chunk[0].group, after, [state.get(p, {}) for p in after], grads,
                                              [e.extremes for e in chunk])
                self._put(batch, chunk, rows, stats.KINDS if key[-1] else stats.KINDS[1:], present)

    @staticmethod
    def _put(batch: stats.Batch, chunk: list[Entry], rows: Tensor, kinds: tuple[str, ...], present: list[bool],
             counts: list[int] | None = None) -> None:
        """The fused capture's ``(len(kinds), k, 3)`` rows of a chunk into its entries' slots of those
        kinds (none for the grad of a parameter whose step left it without one: not ``present``);
        ``counts``: the entries' element counts, where known."""
        counts = counts if counts is not None else [stats.count(e.p) for e in chunk]
        with_grad = [i for i, held in enumerate(present) if held]
        for kind, table in zip(kinds, rows.unbind(0)):
            if kind == "grad" and len(with_grad) < len(chunk):
                batch.put(table[with_grad], [counts[i] for i in with_grad], [chunk[i].slots[kind] for i in with_grad])
            else:
                batch.put(table, counts, [e.slots[kind] for e in chunk])

    def _rebuilt_rows(self, group: dict[str, Any], after: list[Tensor], states: list[dict[str, Any]],
                      grads: list[Tensor], extremes: list[Tensor]) -> Tensor:
        """:func:`~monitored_optim.fused.inverted` of a chunk through the view's fused form, or, where
        it has none for these states, the same rows from the view's eager rebuild and inversion."""
        form = self.view.fused(group, after, states)  # type: ignore[attr-defined]
        if form is not None:
            return self._fuser(fused.inverted, *form, torch.stack(extremes), after, grads, device=after[0].device)
        changes = []
        for p, result, bound in zip(after, rebuild(self.view, group, after, states, [None] * len(after)), extremes):
            u = capture.stored_change(p, result, None, bound.to(p.dtype), meant=False)[0]
            changes.append(torch.zeros_like(p) if u is None else u)
        return fused.grad_and_change_rows(grads, changes)

    def _measure_updates(self, chunk: list[Entry], states: list[dict[str, Any]], batch: stats.Batch) -> None:
        """The stored change of each part of one chunk (one param group, one device): rebuilt by the
        view, then rounding-inverted or taken from the snapshot (:mod:`~monitored_optim.capture`);
        its sums go to ``batch`` and, where they apply, ``lost`` and ``verify`` pieces to the
        parameter's entry. The chunk's temporaries die on return."""
        batch.work.reset()  # the last chunk's stored changes are reduced
        viewed = [i for i, e in enumerate(chunk) if not isinstance(e.snapshot, Cloned)]
        params, views = zip(*[capture.widened(chunk[i].p, states[i]) for i in viewed]) if viewed else ((), ())
        rebuilt = dict(zip(viewed, rebuild(self.view, chunk[0].group, list(params), list(views),
                                           [chunk[i].snapshot for i in viewed])))
        jobs = []
        for i, e in enumerate(chunk):
            result = rebuilt.get(i)
            if isinstance(result, Rows):  # one slice at a time, each reduced before the next is built
                for span, piece in result.slices():
                    u = self._stored(e, piece, span)
                    if u is not None:
                        _record(batch, [e], "u", [u], self._centred([e], "u"), scratch=True)
            else:
                u = self._stored(e, result, state=states[i], work=batch.work)
                if u is not None:
                    jobs.append((e, u))
            e.clone = None
        centre = self._centred([e for e, _ in jobs], "u")
        _record(batch, [e for e, _ in jobs], "u", [u for _, u in jobs], centre, scratch=True)

    def _stored(self, e: Entry, result: Any, span: slice | None = None,
                state: dict[str, Any] | None = None, work: capture.Workspace | None = None) -> Tensor | None:
        """The stored change of entry ``e`` (or of its flat slice ``span``) from the view's
        ``result``; adds its ``lost`` and ``verify`` pieces, and the families' device pieces, to the
        parameter's entry."""
        def cut(t: Tensor | None) -> Tensor | None:
            return t if t is None or span is None else t.detach().view(-1)[span]

        p, before, clone = cut(e.p), cut(e.before), cut(e.clone)
        u, meant = capture.stored_change(p, result, before, e.extremes, work,
                                         meant=self.settings.verify or p.dtype in capture.LOW_PRECISION)
        if u is None:  # the view says nothing moved; verify mode checks that against its clone
            if clone is not None:
                truth = Cloned(clone).update(p)
                self._add_piece(e.owner, "verify", capture.verify_miss(torch.zeros_like(truth), truth, None, p))
            return None
        if p.dtype in capture.LOW_PRECISION:
            self._add_piece(e.owner, "lost", capture.lost(u, meant, cut(e.p.grad)))
        elif before is not None and e.whole.dim() >= 2 and p.dtype in capture.HALF_ULP:  # may it go back to the
            self._add_piece(e.owner, "exact", capture.at_powers_of_two(before, p))  # inversion? (inverted parts:
            # at_powers_of_two_bound, before the step, in _entry)
        truth = u if before is not None else (None if clone is None else Cloned(clone).update(p))
        if truth is not None and self.settings.verify:  # shared storage changes by every sharer's update:
            checked = None if id(e.whole) in self._layout.shared else meant  # not one view's to check
            self._add_piece(e.owner, "verify", capture.verify_miss(u, truth, checked, p))
        where = span if span is not None else e.part.flat_span()
        for fam in self._families:
            for key, value in fam.part(e.name, e.part.whole, u, where, {} if span is not None else state or {},
                                       e.group).items():
                self._add_piece(e.owner, key, value)
        return u

    def _add_piece(self, e: Entry, key: str, value: Tensor) -> None:
        """Add a part's device piece into its parameter's entry, by the key's declared reduction."""
        pieces.accumulate(e.pieces, key, value, self._reductions)

    def _tell_left_out(self, keys: set[str]) -> None:
        """Warn once per key head that the sharded reduction left its figures out, and why."""
        for head in sorted({pieces.head(key) for key in keys} - self._told_left_out):
            self._told_left_out.add(head)
            if self._reductions.get(head) == pieces.WHOLE:
                warn(f"monitored_optim: the {head} figures of matrices sharded across ranks are left out: they "
                     "describe a whole matrix and each rank holds a shard (gathering the matrix would take a "
                     "collective per matrix); matrices that every rank holds whole keep them", RuntimeWarning)
            else:
                shown = ", ".join(sorted(key.replace(":", "/", 1) for key in keys if pieces.head(key) == head))
                warn(f"monitored_optim: {shown} left out under torch.distributed: only the state tensors of "
                     "torch's own optimizers have a place in the one collective", RuntimeWarning)

    def _describe(self, entries: list[Entry], names: list[str]) -> None:
        """Write ``params.json`` for the report when the monitored parameters (``names``, one per entry)
        changed since last time."""
        if tuple(names) != self._described and {"tensorboard", "jsonl"} & set(self.settings.backends) \
                and distributed.is_writer():
            self._described = tuple(names)
            from .describe import write_shapes

            write_shapes(self.settings.logdir / "params.json", self.settings.prefix,
                         [(e.name, e.whole, e.p.dtype) for e in entries])

    def _log(self, figures: dict[str, float]) -> None:
        prefix = self.settings.prefix
        self.latest = {prefix + tag: value for tag, value in figures.items()} if prefix else figures
        self._history.record(self._step, self.latest)
        self._logged = self._step
        _ALL.add(self)
        if distributed.is_writer():  # under torch.distributed only rank 0 opens and writes backends
            _OPEN.add(self)
            over = len(self.latest) > self.settings.tag_budget
            self._backends.log(self.latest, self.step, functools.partial(self._grouped, prefix) if over else None)

    def _grouped(self, prefix: str) -> dict[str, float]:
        """The latest figures grouped by depth for the dashboards (a step over the tag budget); warns
        once if even that is over it."""
        compact = grouping.summarize(self.latest, prefix)
        if len(compact) > self.settings.tag_budget and not self._told_budget:
            self._told_budget = True
            warn(f"monitored_optim: {len(compact)} tags per logging step even grouped by depth, above "
                 f"the tag budget of {self.settings.tag_budget} for TensorBoard, W&B and MLflow; choose what "
                 "is monitored with MonitorConfig(params=..., figures=...) or raise tag_budget")
        return compact


def _assign_slots(blocks: list[Any], first: int) -> None:
    """Give each parameter of a logging step its consecutive slots of :data:`~monitored_optim.stats.KINDS`
    from ``first`` on, in the order of ``blocks``: runs of flat entries (lists) and the lead entry of
    each other parameter. A run that starts at the slot it had on the last logging step keeps its
    entries' slots (given together, the same as now)."""
    width = len(stats.KINDS)
    for block in blocks:
        run = block if isinstance(block, list) else [block]
        if run[0].slots.get("p") != first:
            for k, e in enumerate(run):
                e.slots = {"p": first + width * k, "grad": first + width * k + 1, "u": first + width * k + 2}
        first += width * len(run)


def _flat_chunks(small: list[Entry]) -> list[Flat]:
    """The flat entries cut into chunks of one param group, device and dtype of at most
    :data:`~monitored_optim.fused.FLAT` elements (each entry's ``flat`` set to its chunk)."""
    kinds: dict[tuple[Any, ...], list[Entry]] = {}
    for e in small:
        kinds.setdefault((id(e.group), e.p.device, e.p.dtype), []).append(e)
    chunks = []
    for members in kinds.values():
        sizes = [e.p.numel() for e in members]
        for span in fused.flat_chunks(sizes):
            chunk, lengths = members[span.start:span.stop], sizes[span.start:span.stop]
            params = [x.p for x in chunk]
            chunks.append(Flat(chunk, params, lengths, torch.tensor(lengths, device=params[0].device)))
            for x in chunk:
                x.flat = chunks[-1]
    return chunks


def _dense_grad(p: Tensor) -> bool:
    """Whether ``p`` has a dense grad (torch keeps a grad's dtype, device and shape those of its
    parameter; a sparse one, ``nn.Embedding(sparse=True)``'s, has no fused form)."""
    return p.grad is not None and p.grad.layout is torch.strided


def _grads(params: list[Tensor]) -> tuple[list[Tensor], list[bool]]:
    """Each parameter's grad after the step, dense (a sparse grad of a parameter captured flat, made
    dense), zeros where it has none (a parameter without one, or a step that dropped it: its grad's
    rows are left out), and whether it has one."""
    grads = [p.grad for p in params]
    present = [g is not None for g in grads]
    if all(present) and all(g.layout is torch.strided for g in grads):
        return grads, present
    return ([torch.zeros_like(p) if g is None else g if g.layout is torch.strided else g.to_dense()
             for p, g in zip(params, grads)], present)


def _device_chunks(entries: list[Entry]) -> Iterator[list[Entry]]:
    """``entries`` by device, in chunks of at most :data:`~monitored_optim.fused.CHUNK`."""
    by_device: dict[torch.device, list[Entry]] = {}
    for e in entries:
        by_device.setdefault(e.p.device, []).append(e)
    for members in by_device.values():
        for i in range(0, len(members), fused.CHUNK):
            yield members[i:i + fused.CHUNK]


def _chunks(entries: list[Entry], budget: int) -> Iterator[list[Entry]]:
    """Consecutive entries of one param group and device whose parts together take at most
    ``budget`` bytes (:func:`~monitored_optim.capture.budget`; or one larger part): their rebuilt
    updates are alive at once, so the few temporaries of a chunk are a logging step's extra memory."""
    chunk: list[Entry] = []
    size = 0
    for e in entries:
        if chunk and (size + _nbytes(e.p) > budget or e.group is not chunk[0].group
                      or e.p.device != chunk[0].p.device):
            yield chunk
            chunk, size = [], 0
        chunk.append(e)
        size += _nbytes(e.p)
    if chunk:
        yield chunk


def _nbytes(p: Tensor) -> int:
    return p.numel() * p.element_size()


def _record(batch: stats.Batch, entries: list[Entry], kind: str, xs: list[Tensor], centre: list[bool],
            scale: stats.Scale = None, scratch: bool | list[bool] = False) -> None:
    """Add the sums of ``xs`` (one per entry) to ``batch``, each into its parameter's ``kind`` slot."""
    batch.add(xs, centre, scale, scratch, into=[e.owner.slots[kind] for e in entries])
    for e, flag in zip(entries, centre):
        e.owner.centred[kind] = flag


def _record_grads(batch: stats.Batch, entries: list[Entry], grad_scale: Tensor | None,
                  centre: list[bool] | None = None) -> None:
    """Sums of each ``p.grad`` as the step uses it, into a new ``"grad"`` slot per parameter:
    unscaled when a fused GradScaler step passes its scale; nothing where the grad is ``None``."""
    flags = centre if centre is not None else [True] * len(entries)
    for e in entries:
        if e.lead is None:
            e.slots["grad"] = batch.slot()
    with_grad = [(e, c) for e, c in zip(entries, flags) if e.p.grad is not None]
    scale = None if grad_scale is None else grad_scale.detach().double().reciprocal()  # sums are linear
    _record(batch, [e for e, _ in with_grad], "grad", [e.p.grad for e, _ in with_grad],
            [c for _, c in with_grad], scale)


def _valid_step(value: Any) -> int:
    """``value`` if it is an integer >= 0 (a bool is not), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"opt.monitor.step={value!r} is not valid: expected an integer >= 0")
    return value


def _verify_error(e: Entry, miss: float, truth: float, told: set[str]) -> float:
    """Relative error of the view against the clone; warns once per parameter beyond
    :data:`VERIFY_RTOL` of the update itself."""
    if miss > VERIFY_RTOL * truth and e.name not in told:
        told.add(e.name)
        warn(f"monitored_optim verify: the update of {e.name!r} rebuilt from the optimizer state differs "
             f"from the clone-based truth by {miss:.3g} (norm {truth:.3g}) beyond the rounding of the stored "
             "value; please report it with your torch version and optimizer flags", RuntimeWarning)
    return miss / truth if truth > 0 else (0.0 if miss == 0 else math.inf)


@functools.lru_cache(maxsize=1 << 16)
def _tags(name: str) -> tuple[str, ...]:
    """The per-parameter tags of ``name``, in the order of the columns of ``_parameter_figures``."""
    return (f"param_norm/{name}", f"update_norm/{name}", f"update_to_data/{name}",
            f"grad_norm/{name}", f"grad_to_data/{name}")


def _host_pieces(entries: list[Entry], holding: list[int], values: list[list[float]]
                 ) -> list[dict[str, list[float]]]:
    """Per entry, its pieces' host values (empty but for those at the indices ``holding``, in order),
    from ``values`` in the order of their pieces."""
    values, own = iter(values), [{} for _ in range(len(entries))]
    for i in holding:
        own[i] = {key: next(values) for key in entries[i].pieces}
    return own


def _moment_table(entries: list[Entry], captured: list[int], counts: Tensor | list[float], pairs: Tensor,
                  present: Tensor) -> stats.MomentTable:
    """The host moments of a logging step as one table: ``counts``, the entries' element counts;
    ``pairs``, float64 ``(N, K, 2)`` of ``(mean, m2)`` per kind of :data:`~monitored_optim.stats.KINDS`,
    zeros where ``present`` (bool ``(N, K)``) says a kind had no values (no grad; no update: the
    parameter did not move); ``captured``: the indices of the entries not captured flat (only the
    eager capture's may be uncentred)."""
    uncentred = None  # every entry centred (the fused capture's)
    if any(entries[i].centred for i in captured):
        uncentred = torch.tensor([not e.centred.get(kind, True) for e in entries for kind in stats.KINDS],
                                 dtype=torch.bool).reshape(len(entries), len(stats.KINDS))
    n = torch.as_tensor(counts, dtype=torch.float64).reshape(-1, 1)
    return stats.MomentTable(n, pairs[..., 0], pairs[..., 1], uncentred, present)


def _health_checks(names: list[str], table: stats.MomentTable) -> Checks:
    """The :class:`~monitored_optim.health.Checks` of a logging step from its table: a grad where the
    table has one, unchanged where it had a grad and its update is all zeros, non-finite values,
    grads (where it had one) and updates."""
    has_grad = table.has[:, 1]
    unchanged = has_grad & table.all_zero[:, 2] & (table.n[:, 0] > 0)
    nonfinite = {}
    if not table.finite.all().tolist():  # the usual case has nothing to name (tolist: no scalar read)
        bad = ~table.finite  # a kind without values holds zeros: finite
        rows = bad.any(1)
        nonfinite = {names[i]: tuple(label for label, hit in zip(("value", "grad", "update"), row) if hit)
                     for i, row in zip(rows.nonzero().flatten().tolist(), bad[rows].tolist())}
    return Checks(names, has_grad.tolist(), unchanged.tolist(), nonfinite)


def _tensor_lrs(optimizer: torch.optim.Optimizer) -> dict[int, Tensor]:
    """Index -> lr of each param group whose lr is a Tensor, as a 1-D float64 tensor of one element
    on its device, for the logging step's host copy."""
    return {i: group["lr"].detach().reshape(1).double() for i, group in enumerate(optimizer.param_groups)
            if isinstance(group.get("lr"), Tensor)}


def _group_lrs(optimizer: torch.optim.Optimizer, read: dict[int, list[float]]) -> list[float | None]:
    """Each param group's lr as a float: a number as it is, a Tensor lr from ``read`` (its
    :func:`_tensor_lrs` value on the host), None otherwise (``lr=None``)."""
    return [read[i][0] if i in read else float(group["lr"]) if isinstance(group.get("lr"), (int, float)) else None
            for i, group in enumerate(optimizer.param_groups)]


def _learning_rates(optimizer: torch.optim.Optimizer, lrs: list[float | None]) -> dict[str, float]:
    """``lr/group{i}`` (or ``lr/{name}``) per param group, from its :func:`_group_lrs` ``lrs``."""
    return {f"lr/{_group_label(i, group)}": lr for i, (group, lr) in enumerate(zip(optimizer.param_groups, lrs))
            if lr is not None}


def _group_label(i: int, group: dict[str, Any]) -> str:
    """A param group's ``name`` where it is a string, else ``group{i}``."""
    return group["name"] if isinstance(group.get("name"), str) else f"group{i}"


def _closure_is_first(optimizer_cls: type) -> bool:
    """Whether the base ``step``'s first argument after ``self`` is called ``closure``."""
    try:
        names = list(inspect.signature(raw_step(optimizer_cls)).parameters)
    except (TypeError, ValueError):
        return False
    return names[1:2] == ["closure"]


def _closure(args: tuple[Any, ...], kwargs: dict[str, Any], closure_first: bool) -> Callable[[], Any] | None:
    """The closure a ``step()`` call passes, if any."""
    closure = kwargs["closure"] if "closure" in kwargs else (args[0] if args and closure_first else None)
    return closure if callable(closure) else None


def _record_grads_after_closure(entries: list[Entry], batch: stats.Batch, args: tuple[Any, ...],
                                kwargs: dict[str, Any], closure_first: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Wrap a closure so that the grad moments are those its first call produced.

    A closure-driven step (``SGD.step(closure)``, ``LBFGS``) computes the gradient inside
    ``step()``; what ``p.grad`` held before is stale or ``None``.
    """
    closure = _closure(args, kwargs, closure_first)
    if closure is None:
        return args, kwargs
    done = False

    def wrapped():
        nonlocal done
        loss = closure()
        if not done:
            done = True
            for e in entries:  # the parts of a large parameter were cut from the grad before the closure
                if e.part is not None:
                    e.part.regrad()
            with torch.no_grad():
                _record_grads(batch, entries, None)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": wrapped}
    return (wrapped, *args[1:]), kwargs


def _make_logdir(settings: Settings) -> None:
    """Create the log directory now when a file backend will write there, so that a bad path fails
    at construction rather than at the first logging step."""
    if not {"tensorboard", "jsonl"} & set(settings.backends):
        return
    try:
        settings.logdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"monitored_optim cannot create the log directory {str(settings.logdir)!r}: "
                      f"{err.strerror or err}") from err


def _check_installed(backends: tuple[str, ...]) -> None:
    import importlib.util

    package = {"tensorboard": "tensorboardX", "wandb": "wandb", "jsonl": None, "mlflow": "mlflow"}
    for name in backends:
        module = package[name]
        if module and importlib.util.find_spec(module) is None:
            raise ImportError(f"monitored_optim backend {name!r} needs the {module} package: "
                              f"pip install {module}")


_OPEN: "weakref.WeakSet[Monitor]" = weakref.WeakSet()
_ALL: "weakref.WeakSet[Monitor]" = weakref.WeakSet()


def _warn_if_shared(settings: Settings) -> None:
    """Warn when another live monitor logs the same tags to the same place (two optimizers built in
    the same second share the default ``runs/<time>_<host>``): their figures would overwrite each other."""
    for other in list(_ALL):
        same = other.settings
        if (same.prefix == settings.prefix and set(same.backends) & set(settings.backends)
                and same.logdir.resolve() == settings.logdir.resolve()):
            warn(f"monitored_optim: two monitored optimizers log the same tags to {str(settings.logdir)!r}; "
                 "give each one MonitorConfig(prefix=...) (or its own logdir) to keep their figures apart")
            return


@atexit.register
def _close_all() -> None:
    for monitor in list(_OPEN):
        monitor.close()

"""The Monitor: the public ``opt.monitor``, and the flow of one ``step()``.

A step that does not log calls the base step and counts it, nothing else. A logging step runs
these stages, each a call into the module that owns it:

1. cadence: is this a logging step? (:meth:`Monitor.run`)
2. plan and capture before the step: each parameter's p_before by its route, and the sums of
   p_before and the grads (:class:`~monitored_optim.capture.Capture`, ``before``);
3. the base step, called once (its hooks fire once);
4. capture after the step: each stored change u and its sums (``Capture.after``);
5. reduce: one device-to-host copy, or under ``torch.distributed`` one all_reduce
   (:func:`_hosted`, :mod:`monitored_optim.distributed`);
6. figures (:class:`~monitored_optim.figures.Figures`), then the capture rules' memories for the
   next logging step (``Capture.remember``);
7. deliver: ``latest``, ``params.json`` and the backends, on the writing rank (:meth:`Monitor._deliver`).
"""

from __future__ import annotations

import atexit
import functools
import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import amp, distributed, engine, families, grouping, host, pieces, stats, usage
from ._warnings import warn
from .backends import Fanout
from .capture import Capture, Workspace, closure_is_first, closure_of, with_grads_of_closure
from .capture.plan import Entries, Entry, Roster, names as _names
from .capture.spent import timed
from .config import MonitorConfig, Settings, resolve
from .history import History
from .families.base import Family
from .figures import Figures, group_lrs, tensor_lrs
from .health import Health
from .updates import View, view_for
from .updates.view import adopt


def _gc_paused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with Python's cyclic garbage collector paused (and resumed after, if it was on).

    A logging step allocates a few Python objects per parameter, most freed by reference counting
    when it returns; the pause keeps them from triggering collections that scan the whole training
    process's heap in the middle of the step."""
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
        self._closure_first = closure_is_first(optimizer_cls)
        self._step = 0
        self._logged = 0
        self._told_back = False
        self._told_budget = False
        self._told_left_out: set[str] = set()
        self._told_unmapped = False
        self._described: tuple[str, ...] = ()
        self.base_calls = 0
        self.latest: dict[str, float] = {}
        self.health = Health()
        chosen = families.build(self.settings.figures)
        self._reductions = pieces.declared(chosen)  # head of each piece key -> its reduction
        self._piece_keys = pieces.keys(chosen)  # the sharded table's rows per parameter
        self.capture = Capture(self.view, self.settings, chosen, self._reductions)
        self._figures = Figures(self.settings, chosen, self.health, self.capture.held)  # no cycle through self
        self._history = History()
        self._backends = Fanout(self.settings.backends, self.settings.logdir, self.settings.strict, self.settings.sinks)
        self._optimizer: Callable[[], torch.optim.Optimizer | None] = lambda: None
        self._ranks = distributed.Ranks()  # the names every rank monitors, once exchanged
        self._engine: engine.EngineSteps | bool | None = None  # DeepSpeed's steps once found, False: none
        self._born: dict[int, str] = {}  # id -> name of the parameters the optimizer was built with
        self._looked: set[int] = set()  # ids of tensors that led a param group when no DeepSpeed was found
        self._usage = usage.Usage(optimizer_cls.__name__)
        weakref.finalize(self, usage.UNSTEPPED.append, self._usage)  # told at exit if it was never stepped
        self._watched: list[weakref.ref[torch.nn.Module]] = []
        self._model_names: dict[int, str] = {}
        self._warned_unnamed = False
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
        """Bind to the optimizer once it is built: bind the view to it, watch ``config.model``, warn
        about unnamed parameters, find matrices the snapshot rule takes from the first logging step."""
        self._optimizer = weakref.ref(optimizer)
        self._usage.built = True
        bound = self.view.bound(optimizer)
        try:
            self.view = adopt(bound)
        except TypeError as err:
            raise TypeError(f"monitored_optim: {type(self.view).__name__}.bound() returned {bound!r} for "
                            f"{type(optimizer).__name__}, not a view ({err})") from err
        self.capture.use(self.view)
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
        self._born = {id(p): n for n, p in every}
        chosen = [(n, p) for n, p in every if self.settings.select(n, p)]
        if every and not chosen:
            warn(f"monitored_optim: the parameter selection (MonitorConfig params=/exclude= or MONITORED_OPTIM_PARAMS) "
                 f"matches none of the {len(every)} parameters, so nothing is monitored; their names look like "
                 f"{every[0][0]!r}", RuntimeWarning)
        self.capture.risk.mark_when_built(chosen)

    def watch(self, model: torch.nn.Module) -> list[str]:
        """Name the optimizer's parameters after ``model``'s, and warn about those it does not hold.

        Parameters that param groups hold without names get the names ``model.named_parameters()``
        gives them (a tied weight its first name); each trainable parameter of ``model`` that no
        param group holds is warned about once.

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
        return self.health.check_watched(model, self._held_params(optimizer)) if optimizer is not None else []

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
        return describe(self, optimizer, self._model_names)

    def history(self) -> Any:
        """The figures of the logging steps kept in memory, as a pandas ``DataFrame``.

        One row per logging step (index ``step``), one float32 column per tag, NaN where a step did
        not log it.

        Bounded (``monitored_optim.history``): at most 4,194,304 values (16 MiB) in rows evenly
        spaced over the whole run, and the last logging step.

        Raises:
            ImportError: pandas is not installed (``pip install 'monitored_optim[notebook]'``).
        """
        return self._history.frame()

    def plot(self, params: str | None = None) -> Any:
        """The report's update-to-data figure of this run, from memory, as a matplotlib ``Figure``.

        Jupyter shows it inline; ``fig.savefig("u.png")`` writes it (``monitored_optim.report.draw_run``).
        ``params``: a glob on parameter names (default: the report's choice of matrices).

        Raises:
            ReportError: nothing logged yet, matplotlib is missing, or ``params`` matches no parameter.
        """
        from .report.plot import draw_run

        return draw_run(self._run(), params=params)

    def report(self, last: int = 20) -> Any:
        """The report table of this run, from memory, as a ``monitored_optim.report.Summary``.

        Medians cover the ``last`` logging steps (int >= 1); Jupyter renders it as the table and
        ``print`` as text.

        Raises:
            ReportError: nothing logged yet.
        """
        from .report.summary import summarize

        return summarize(self._run(), last)

    def _run(self) -> Any:
        """The history as the report's ``Run``, named after the optimizer's class; kinds from shapes."""
        from pathlib import Path

        from .describe import kind

        optimizer = self._optimizer()
        groups = [] if optimizer is None else zip(optimizer.param_groups, _names(optimizer, self._model_names))
        kinds = {self.settings.prefix + n: kind(p) for group, names in groups for n, p in zip(names, group["params"])}
        label = type(optimizer).__name__ if optimizer is not None else "run"
        return self._history.run(Path(self.settings.prefix + label), kinds)

    def run(self, optimizer: torch.optim.Optimizer, step_fn: Callable[..., Any],
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``step_fn(optimizer, *args, **kwargs)`` (the unhooked base step) once and monitor it.

        Under ``torch.compile(opt.step)`` a non-logging step traces to the plain optimizer's graph;
        a logging step runs the capture before and after the base step outside the compiled graphs
        (``torch.compiler.disable``), while the base step itself stays compiled, so the trajectory
        is the plain compiled optimizer's.

        Returns what the base step returns (the closure's loss, if any).
        """
        if self._engine is None or self._engine is False and self._replaced(optimizer):
            self._usage.stepped = usage.ANY.stepped = True
            self._engine = engine.find(self, optimizer) or False
            if not self._engine:
                self._looked.update(id(group["params"][0]) for group in optimizer.param_groups if group["params"])
        if self._engine:
            return self._engine.call(optimizer, step_fn, args, kwargs)
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
        pending = self._open(optimizer)
        made, args, kwargs = self._before(pending, args, kwargs)
        self.base_calls += 1
        out = step_fn(optimizer, *args, **kwargs)
        self._after(pending, made)
        self._finish(optimizer, pending)
        return out

    def _replaced(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a param group now leads with a tensor the optimizer was not built with and not yet
        looked into (DeepSpeed puts its flat buffers there after a first step taken without it): the
        engine is looked for again (:func:`~monitored_optim.engine.find`)."""
        return any(group["params"] and id(group["params"][0]) not in self._born
                   and id(group["params"][0]) not in self._looked for group in optimizer.param_groups)

    @torch.compiler.disable
    def _open(self, optimizer: torch.optim.Optimizer, layout: Any = None) -> _Pending:
        """A logging step: its sharding (None outside torch.distributed) and its batch of sums."""
        return _Pending(distributed.sharding(optimizer, layout), stats.Batch(Workspace()))

    @torch.compiler.disable
    @_gc_paused
    @timed()
    def _before(self, pending: _Pending, args: tuple[Any, ...], kwargs: dict[str, Any],
                groups: set[int] | None = None) -> tuple[Entries, tuple[Any, ...], dict[str, Any]]:
        """Stage 2: the capture before a base step (of the param groups ``groups``, None: all); returns
        the entries it made and the step's arguments, a closure wrapped to record the grads it makes."""
        optimizer, sharding = self._optimizer(), pending.sharding
        if not (self._engine or self._told_unmapped):  # a known DeepSpeed wrapper's buffers are mapped
            self._tell_unmapped(optimizer)
        grad_scale = getattr(optimizer, "grad_scale", None)
        fuse = (sharding is None and grad_scale is None and not self.settings.verify
                and closure_of(args, kwargs, self._closure_first) is None
                and all(type(fam).part is Family.part for fam in self.capture.eager.families))
        entries = self.capture.before(optimizer if sharding is None else sharding.local, pending.batch, grad_scale,
                                      self._model_names, split=sharding is None, fuse=fuse,
                                      cloned=sharding.cloned(self.view) if sharding is not None else frozenset(),
                                      groups=groups)
        pending.entries.extend(entries)
        return (entries, *with_grads_of_closure(entries.all, pending.batch, args, kwargs, self._closure_first))

    @torch.compiler.disable
    @_gc_paused
    @timed()
    def _after(self, pending: _Pending, entries: Entries) -> None:
        """Stage 4: the capture after a base step, of the ``entries`` taken before it."""
        read = self._optimizer() if pending.sharding is None else pending.sharding.local
        self.capture.after(read.state, entries, pending.batch)

    @torch.compiler.disable
    @_gc_paused
    @timed(last=True)
    def _finish(self, optimizer: torch.optim.Optimizer, pending: _Pending) -> None:
        """Stages 5 to 7: count the step, reduce, compute the figures, deliver."""
        self._step += 1
        sharding, entries = pending.sharding, pending.entries
        self.capture.finish(entries)
        roster = self.capture.roster(entries, None if sharding is None else sharding.shape)
        source = self._engine.layout.optimizer() if self._engine else optimizer  # all of DeepSpeed's groups
        lr_values = tensor_lrs(source)
        hosted, read_lrs, reduced = self._hosted(entries, roster, pending.batch.finish(), sharding, lr_values)
        lrs = group_lrs(source, dict(zip(lr_values, read_lrs)))
        groups = (optimizer if sharding is None else sharding.local).param_groups
        everyone = roster if reduced is None else roster.joined(reduced.remote, reduced.names)
        local = [float(g["lr"]) if isinstance(g.get("lr"), (int, float)) else None for g in groups] \
            if self._engine else None  # DeepSpeed's flat buffers: a group each, sub-groups at stage 3
        figures = self._figures.compute(self.step, everyone, hosted, source, lrs, groups, local)
        self.capture.remember(roster, hosted if everyone is roster else hosted.head(len(roster.names)))
        figures.update(self.capture.spent.figures(self.settings.figures, None if reduced is None else reduced.cost))
        self._deliver(figures, everyone)
        for model in (ref() for ref in self._watched):
            if model is not None:
                self.health.check_watched(model, self._held_params(optimizer))

    def _held_params(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        """The model's parameters that the optimizer steps (under DeepSpeed, those in its flat buffers)."""
        if self._engine:
            return self._engine.model_params()
        return [p for group in optimizer.param_groups for p in group["params"]]

    def _hosted(self, entries: Entries, roster: Roster, rows: stats.Moments, sharding: distributed.Sharding | None,
                lr_values: dict[int, Tensor]) -> tuple[host.Hosted, list[list[float]], Any]:
        """Stage 5: the step's moments and pieces on the host, the Tensor lrs' values, and under
        ``torch.distributed`` the reduction's names (the parameters that other ranks monitor after this
        rank's; None outside): one host copy per device, or one all_reduce (and one host copy for
        Tensor lrs)."""
        leads = entries.leads
        if sharding is None:
            holding = [i for i in roster.captured if leads[i].pieces]  # a flat entry has none
            held = [piece for i in holding for piece in leads[i].pieces.values()]
            index = roster.index
            pairs, present, extra = rows.host(index, held + list(lr_values.values()))
            counts = rows.sizes[index[:, 0]]  # p_before's rows cover each parameter once
            own, read = host.pieces(leads, holding, extra[:len(held)]), extra[len(held):]
            reduced = None
        else:  # whole-parameter values and counts
            for e in leads:
                e.pieces.update({kind: rows[slot] for kind, slot in e.slots.items() if rows[slot] is not None})
            reduced = sharding.reduce(leads, self._piece_keys, self._ranks, self.capture.spent.so_far())
            counts, pairs, present, own = reduced.counts, reduced.pairs, reduced.present, reduced.pieces
            self._tell_left_out(sharding.left_out)
            read = stats.Moments({}, {}, 0, torch.zeros(0)).host(torch.zeros(0, dtype=torch.long),
                                                               list(lr_values.values()))[2]
        return host.Hosted(host.table(leads, roster.captured, counts, pairs, present), own), read, reduced

    def close(self) -> None:
        """Flush and close every backend and let go of the parameters the layout holds (idempotent; also
        run at interpreter exit)."""
        self.capture.release()
        self._backends.close()
        usage.tell_unstepped([self._usage])
        _OPEN.discard(self)
        _ALL.discard(self)  # a monitor resumed into the same logdir after this one is no clash

    def _tell_unmapped(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn once where a param group's names are not as many as its tensors: an engine (an
        optimizer wrapper this monitor does not know) stepped buffers of its own, named param{k}."""
        odd = [group for group in optimizer.param_groups
               if group.get("param_names") and len(group["param_names"]) != len(group["params"])]
        if odd:
            self._told_unmapped = True
            warn(f"monitored_optim: a param group names {len(odd[0]['param_names'])} parameters but holds "
                 f"{len(odd[0]['params'])} tensor(s): something replaced them with buffers of its own that the monitor "
                 "cannot map back to the named parameters, so their figures are logged as param0, param1, ... (the "
                 "tensors the optimizer steps), not under the parameters' names", RuntimeWarning)

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

    def _deliver(self, figures: dict[str, float], roster: Roster) -> None:
        """Stage 7: ``latest``, then on the writing rank ``params.json`` (when the parameters changed)
        and the backends (over the tag budget, the dashboards get the figures grouped by depth)."""
        prefix = self.settings.prefix
        self.latest = {prefix + tag: value for tag, value in figures.items()} if prefix else figures
        self._history.record(self._step, self.latest)
        self._logged = self._step
        _ALL.add(self)
        if not distributed.is_writer():  # under torch.distributed only rank 0 opens and writes backends
            return
        if tuple(roster.names) != self._described and {"tensorboard", "jsonl"} & set(self.settings.backends):
            self._described = tuple(roster.names)
            from .describe import write_shapes

            write_shapes(self.settings.logdir / "params.json", self.settings.prefix,
                         list(zip(roster.names, roster.shapes, roster.dtypes)))
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


def _valid_step(value: Any) -> int:
    """``value`` if it is an integer >= 0 (a bool is not), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"opt.monitor.step={value!r} is not valid: expected an integer >= 0")
    return value


class _Pending:
    """A logging step in progress: its sharding (None outside torch.distributed), its batch of sums and
    the entries captured so far."""

    __slots__ = ("sharding", "batch", "entries")

    def __init__(self, sharding: distributed.Sharding | None, batch: stats.Batch) -> None:
        self.sharding, self.batch, self.entries = sharding, batch, Entries()


def _make_logdir(settings: Settings) -> None:
    """Create the log directory of the file backends now, so that a bad path fails at construction."""
    if not {"tensorboard", "jsonl"} & set(settings.backends):
        return
    try:
        settings.logdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"monitored_optim cannot create the log directory {str(settings.logdir)!r}: "
                      f"{err.strerror or err}") from err


def _check_installed(backends: tuple[str, ...]) -> None:
    """Fail at construction for a backend whose package is missing.

    Raises:
        ImportError: naming the backend, its package and the extra that installs it.
    """
    import importlib.util

    for name in backends:
        module, extra = _PACKAGES[name]
        if module and importlib.util.find_spec(module) is None:
            how = f"pip install 'monitored_optim[{extra}]'" if extra else f"pip install {module}"
            raise ImportError(f"monitored_optim backend {name!r} needs the {module} package: {how}")


_PACKAGES = {"tensorboard": ("tensorboardX", None), "wandb": ("wandb", "wandb"), "jsonl": (None, None),
             "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio"), "swanlab": ("swanlab", "swanlab"),
             "comet": ("comet_ml", "comet")}
"""Backend -> (the module it imports, the extra that installs it)."""


_OPEN: "weakref.WeakSet[Monitor]" = weakref.WeakSet()
_ALL: "weakref.WeakSet[Monitor]" = weakref.WeakSet()


def _warn_if_shared(settings: Settings) -> None:
    """Warn when another live monitor of this process logs the same tags to the same place.

    Two optimizers built in the same second share the default ``runs/<time>_<host>``, and their
    figures would overwrite each other."""
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
    usage.tell_unstepped([monitor._usage for monitor in list(_ALL)] + usage.UNSTEPPED)

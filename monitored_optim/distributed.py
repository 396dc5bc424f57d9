"""Sharded and replicated training: every figure describes the whole parameter, written once.

Under ``torch.distributed`` each rank holds a shard of each parameter, or a copy of it. On a
logging step the monitor reads, through ``Sharding.local``, only plain local tensors: the views
rebuild the update of the local shard, and :func:`monitored_optim.stats.moments` reduces p_before,
grad and update of the local shard to ``(mean, m2)`` exactly as in the single-process path (no
DTensor reduction, so no hidden collective). :meth:`Sharding.reduce` turns them into weighted power
sums in float64

    (w·n, w·Σx, w·Σx²),   Σx = n·mean,   Σx² = m2 + n·mean²,

stacks them into one table (per parameter: a row for each piece the step may hold, by its declared
reduction, :mod:`monitored_optim.pieces`) and calls **one** ``all_reduce(SUM)`` over the default process group,
then copies the table to the host once. For the whole parameter of N elements,
``mean = Σx / N`` and ``m2 = Σx² - Σx·mean`` (Chan, Golub & LeVeque 1979, in power-sum form).
Precision: the float64 cancellation costs ``~1e-16·(mean/std)²`` of m2 (1e-8 for a LayerNorm weight
near 1.0 with std 1e-4); the float32 rounding δ of each shard's mean costs ``~2·δ·Δμ/std²`` (Δμ the
gap between the shards' means), ~1e-5 of m2 for that weight on 256-element shards.

The weight ``w`` of a local shard is ``1 / (number of ranks holding that same shard)``, so that every
element of every parameter counts exactly once over the world of ``W`` ranks:

========================================================  ==========================================
parameter as the optimizer sees it                        w
========================================================  ==========================================
plain tensor (DDP, tensor-parallel unplanned, ZeRO        ``1 / W`` (every rank holds a replica)
wrapped as the monitored class)
``DTensor`` (FSDP2 ``fully_shard``, tensor parallel)      ``S / W``, S = product of the mesh sizes of
                                                          the dimensions whose placement is not
                                                          ``Replicate`` (``Shard``, ``_StridedShard``,
                                                          any other); a ``Partial`` grad is first
                                                          redistributed to the parameter's placements
                                                          (one more collective, only then)
FSDP1 parameter (``use_orig_params=True`` views, or       ``S / W``, S = size of the unit's sharding
the ``FlatParameter`` itself, its padding excluded)       group (1 for ``NO_SHARD``)
ZeRO inner optimizer (``optimizer_class=Monitored(…)``)   ``G / W`` on the rank owning the parameter in
                                                          ZeRO's group of size G, 0 elsewhere
========================================================  ==========================================

Uneven and empty shards need nothing special: an empty shard contributes ``n = 0`` (its NaN mean is
masked). A value missing on a rank (no grad on an empty FSDP1 shard, an unchanged shard) counts as
zeros there; a grad exists if any rank had one. Every rank always joins the collective, whatever it
holds, and builds the same table layout (the same parameters in the same order, for a ZeRO inner
optimizer ZeRO's full list); a fingerprint of the names travels in the table, and a rank that failed
to build its part still joins with a failure flag, so a disagreement or a failure raises on every
rank instead of hanging or mixing up figures. Views that are not element-wise (Muon, Adafactor)
cannot rebuild a shard's update from the shard: split parameters get a clone of their local shard
(:meth:`Sharding.cloned`). Only rank 0 of the default group writes to the backends
(:func:`is_writer`); every rank gets the global figures.

Assumptions (SPMD training): every rank of the default group calls ``step()`` of its monitored
optimizer on the same steps, over the same named parameters; a plain tensor is a replica of the same
parameter on every rank; the meshes and groups of sharded parameters, with their replicas, tile the
world. Ranks that monitor different parameters (pipeline stages) are refused when their tables have
the same size; otherwise the collective itself fails (gloo aborts: "Received data size doesn't match
expected size").

Sources: ``torch/distributed/tensor/placement_types.py`` (placements),
``torch/distributed/fsdp/_flat_param.py`` (FSDP1 views and padding),
``torch/distributed/optim/zero_redundancy_optimizer.py`` (ZeRO partition and ``_local_step``).
"""

from __future__ import annotations

import gc
import math
import sys
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import stats
from .pieces import MOMENTS, NORM, SUM, WHOLE
from .updates import elementwise

_COLUMNS = 4
"""Table columns (see :meth:`Sharding._table`)."""


def initialized() -> bool:
    """True when ``torch.distributed`` is available and its default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def is_writer() -> bool:
    """True in the one process that writes figures: rank 0 of the default group, or any process
    that is not part of an initialised ``torch.distributed`` job."""
    return not initialized() or dist.get_rank() == 0


def sharding(optimizer: torch.optim.Optimizer) -> Sharding | None:
    """The :class:`Sharding` of ``optimizer`` for this logging step, or ``None`` outside
    ``torch.distributed`` (the single-process path, untouched).

    Call on every rank at the same logging step, before the base step (it reads the grads).
    Issues no collective unless a grad is laid out unlike its parameter (a ``Partial`` grad), which
    is redistributed to the parameter's placements.
    """
    if not initialized():
        return None
    return Sharding(optimizer)


class Sharding:
    """One logging step's view of a sharded optimizer: local tensors to read, weights, the reduction.

    Attributes:
        local: an optimizer-like object (``param_groups``, ``state``, ``defaults``) for the monitor to
            read instead of the optimizer: the same groups (for a ZeRO inner optimizer, ZeRO's groups
            with every parameter, so that all ranks see the same list), each parameter replaced by
            its local shard as a plain tensor (a detached alias of the DTensor's local tensor, or of
            the FSDP1 flat shard without padding) whose ``.grad`` is the matching local grad; the
            ``state`` mapping answers for a local shard with the state of its parameter, each
            ``DTensor`` in it replaced by its local tensor. Plain tensors are passed through as is.
        weights: ``list[float]``, the weight w of each parameter's local shard, in ``local`` order.
        world: number of ranks W of the default group.

    Raises:
        RuntimeError: from :meth:`reduce` when ranks disagree on the monitored parameters.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.world = dist.get_world_size()
        zero = _zero_parent(optimizer)
        source = zero if zero is not None else optimizer
        self._state = optimizer.state
        self._orig: dict[int, Tensor] = {}
        self._slot: dict[int, int] = {}
        self._narrow: dict[int, int] = {}
        self._split: set[int] = set()
        self._grad_seen: dict[int, Tensor | None] = {}
        self._regrad: set[int] = set()
        self.weights: list[float] = []
        self.left_out: set[str] = set()
        groups = []
        for group in source.param_groups:
            shards = []
            for p in group["params"]:
                shard, weight, valid = self._shard(p, optimizer, zero)
                self._orig[id(shard)] = p
                if shard is not p:
                    self._grad_seen[id(shard)] = p.grad
                self._slot[id(shard)] = len(self.weights)
                if valid is not None:
                    self._narrow[id(shard)] = valid
                if _is_split(p, zero):
                    self._split.add(id(shard))
                self.weights.append(weight)
                shards.append(shard)
            groups.append({**group, "params": shards})
        self.local = _LocalOptimizer(groups, _LocalState(self), optimizer.defaults)

    def _shard(self, p: Tensor, optimizer: torch.optim.Optimizer,
               zero: Any) -> tuple[Tensor, float, int | None]:
        """(local shard, weight, valid numel when the shard narrows away FSDP1 padding)."""
        if zero is not None:
            owner = zero._param_to_rank.get(p)
            return p, (zero.world_size / self.world if owner == zero.rank else 0.0), None
        if _is_dtensor(p):
            return _dtensor_shard(p), _dtensor_shards(p) / self.world, None
        if getattr(p, "_fsdp_flattened", False):
            unit = _fsdp1_unit(p)
            if unit is not None:
                weight = _fsdp1_shards(unit) / self.world
                padded = getattr(p, "_shard_numel_padded", 0) if p is unit._handle.flat_param else 0
                if padded:
                    valid = p.numel() - padded
                    shard = p.detach()[:valid]
                    _set_local_grad(shard, p, valid)
                    return shard, weight, valid
                return p, weight, None
        return p, 1.0 / self.world, None

    def cloned(self, view: Any) -> frozenset[int]:
        """The ids of the local shards whose update ``view`` cannot rebuild: shards of split parameters
        (a sharded DTensor, an FSDP1 shard) where the view is not element-wise (Muon's Newton-Schulz on
        the whole matrix, Adafactor's row and column means). The capture's plan clones them: exact,
        one copy of the shard on logging steps. Whole parameters (replicas, ZeRO) keep the view."""
        return frozenset() if elementwise(view) else frozenset(self._split)

    def refresh_grad(self, shard: Tensor) -> None:
        """Point ``shard.grad`` at the parameter's current grad, if a closure made a new one.

        The capture reads ``state`` just before each view call."""
        if id(shard) in self._grad_seen:
            p = self.original(shard)
            if p.grad is not self._grad_seen[id(shard)]:
                self._grad_seen[id(shard)] = p.grad
                self._regrad.add(id(shard))
                _set_local_grad(shard, p, self._narrow.get(id(shard)))

    def original(self, shard: Tensor) -> Tensor:
        """The parameter whose local shard is ``shard``."""
        return self._orig.get(id(shard), shard)

    def localize_state(self, shard: Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as ``shard`` sees it: local tensors of DTensors, FSDP1 shards narrowed like it.

        A plain state dict is returned as is."""
        valid = self._narrow.get(id(shard))
        if valid is None and not any(_is_dtensor(v) for v in state.values()):
            return state
        full = self.original(shard).shape
        out = {}
        for key, value in state.items():
            if _is_dtensor(value):
                value = value.to_local()
            elif valid is not None and isinstance(value, Tensor) and value.shape == full:
                value = value[:valid]
            out[key] = value
        return out

    def reduce(self, entries: list[Any], keys: dict[str, str]
               ) -> tuple[list[float], Tensor, Tensor, list[dict[str, list[float]]]]:
        """Global host values of every entry's device pieces: ONE ``all_reduce`` (SUM) of one float64
        table, then one device-to-host copy.

        A piece whose key is not in ``keys``, and a WHOLE piece of a parameter this rank holds only a
        shard of, is left out and its key added to ``left_out``.

        Args:
            entries: the monitor's entries, in ``local`` order; each has ``.name``, ``.p`` (a local
                shard from ``local``) and ``.pieces``, a dict of float64 device tensors computed
                from the local shard: ``"p"``, ``"grad"``, ``"u"`` (``(mean, m2)`` from
                :func:`~monitored_optim.stats.moments`, shape ``(2,)``), ``"lost"`` (a count, shape
                ``(1,)``), ``"exact"`` (a sum, :func:`~monitored_optim.capture.rules.at_powers_of_two`, shape
                ``(1,)``), ``"verify"`` (two L2 norms, shape ``(2,)``). A piece may be missing on a
                rank (no grad there, an unchanged local shard, an empty shard).
            keys: every key a piece may have -> its reduction (:mod:`monitored_optim.pieces`), the same
                on every rank: the table's rows per parameter, in order.

        Returns:
            ``(counts, pairs, present, pieces)``, as the single-process path builds them from
            ``stats.Moments.host``, for the whole parameters: per entry N, its total element count (a
            float holding an integer); float64 ``(E, 3, 2)``, the ``(mean, m2)`` over all N elements
            of each of :data:`~monitored_optim.stats.KINDS` (a piece missing on a rank counting as
            zeros there; zeros where no rank had it); bool ``(E, 3)``, whether some rank had it; and
            per entry a dict of the other pieces that some rank had (``[count]``, ``[norm, norm]``).

        Raises:
            RuntimeError: ranks disagree on the parameter names or count, or a rank failed to build
                its part of the table (raised on every rank after the collective, so that none hangs).
        """
        slots = len(self.weights)
        names = [getattr(e, "name", "") for e in entries]
        fingerprint = float(zlib.crc32("\n".join([str(slots), *names]).encode()) & 0xFFFF)
        local_error: Exception | None = None
        try:
            table = self._table(entries, fingerprint, keys)
        except Exception as err:  # join the collective anyway: a rank that skips it hangs the job
            local_error = err
            table = _empty_table(slots * len(keys), fingerprint, _default_device())
            table[0, 3] = 1.0
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
        host = table.tolist() if table.device.type == "cpu" else table.cpu().tolist()
        count, f_sum, f_sq, failed = host[0]
        if failed:
            here = f" (this rank: {type(local_error).__name__}: {local_error})" if local_error else ""
            raise RuntimeError(f"monitored_optim: {int(failed)} rank(s) could not reduce their figures{here}") \
                from local_error
        if count != self.world or f_sum != self.world * fingerprint or f_sq != self.world * fingerprint ** 2:
            raise RuntimeError(
                "monitored_optim: the ranks of the default process group monitor different parameters "
                "(their names or number differ), so figures cannot be combined. Every rank must step a "
                "monitored optimizer over the same named parameters on the same steps (data, tensor and "
                "fully sharded parallelism); pipeline stages that own different parameters are not supported.")
        counts, pairs, present, pieces = [], [], [], []
        for e in entries:
            n, got = _hosted(host, self._slot[id(e.p)], keys)
            counts.append(n)
            pairs += [got.get(kind, [0.0, 0.0]) for kind in stats.KINDS]
            present += [kind in got for kind in stats.KINDS]
            pieces.append({key: value for key, value in got.items() if key not in stats.KINDS})
        shape = (len(entries), len(stats.KINDS))
        return (counts, torch.tensor(pairs, dtype=torch.float64).reshape(*shape, 2),
                torch.tensor(present, dtype=torch.bool).reshape(shape), pieces)

    def _table(self, entries: list[Any], fingerprint: float, keys: dict[str, str]) -> Tensor:
        """The local table, shape ``(1 + K·slots, 4)`` float64 (K = ``len(keys)``). Row 0:
        ``(1, f, f², failed)``. Per parameter slot s, rows ``1 + Ks + k`` for the keys in order,
        columns by reduction: MOMENTS ``(w·n, w·Σx, w·Σx², present)``, SUM and WHOLE
        ``(w·c, 0, 0, present)``, NORM ``(w·a², w·b², 0, present)``; ``present`` is 1 where the rank
        had the piece (unweighted).
        Built with one stack of the pieces, one small host-to-device copy and one scatter."""
        order = {key: i for i, key in enumerate(keys)}
        values, meta = [], []  # meta per piece: (table row, w·n, w, n > 0, reduction code)
        for e in entries:
            slot = self._slot.get(id(e.p))
            if slot is None:
                raise KeyError(f"entry {getattr(e, 'name', '?')!r} is not a parameter of this step's Sharding.local")
            if id(e.p) in self._regrad:  # a closure made a new grad inside step(): the shard saw it late
                e.pieces.pop("grad", None)
                if e.p.grad is not None:
                    e.pieces["grad"] = stats.moments(e.p.grad)
            w, n = self.weights[slot], float(stats.count(e.p))
            for key, value in e.pieces.items():
                how = keys.get(key)
                if how is None or (how == WHOLE and id(e.p) in self._split):
                    self.left_out.add(key)
                    continue
                values.append(value.reshape(-1))
                meta.append((1 + len(keys) * slot + order[key], w * n, w, float(n > 0), _CODE[how]))
        device = values[0].device if values else _default_device()
        table = _empty_table(len(self.weights) * len(keys), fingerprint, device)
        if not values:
            return table
        x = torch.stack([torch.nn.functional.pad(v.to(device=device, dtype=torch.float64), (0, 2 - v.numel()))
                         for v in values])
        row, wn, w, nonempty, kind = torch.tensor(meta, dtype=torch.float64).to(device).unbind(1)
        a, b = x.unbind(1)
        zero = torch.zeros_like(wn)
        w_sum = torch.where(nonempty > 0, wn * a, zero)  # moments: a = mean, b = m2 (NaN mean if empty)
        moments = torch.stack([wn, w_sum, torch.where(nonempty > 0, w * b + w_sum * a, zero)], 1)
        count = torch.stack([w * a, zero, zero], 1)
        norms = torch.stack([w * a.square(), w * b.square(), zero], 1)
        k = kind.unsqueeze(1)
        sums = torch.where(k == _CODE[MOMENTS], moments, torch.where(k == _CODE[NORM], norms, count))
        table.index_copy_(0, row.long(), torch.cat([sums, torch.ones_like(wn).unsqueeze(1)], 1))
        return table


_CODE = {MOMENTS: 0.0, SUM: 1.0, WHOLE: 1.0, NORM: 2.0}
"""Each reduction's code in the table build (SUM and WHOLE sum alike)."""


def _empty_table(rows: int, fingerprint: float, device: torch.device) -> Tensor:
    """A table of ``rows`` piece rows after the header row ``(1, f, f², 0)``."""
    table = torch.zeros(1 + rows, _COLUMNS, dtype=torch.float64, device=device)
    table[0, :3] = torch.tensor([1.0, fingerprint, fingerprint * fingerprint], dtype=torch.float64)
    return table


def _hosted(host: list[list[float]], slot: int, keys: dict[str, str]) -> tuple[float, dict[str, list[float]]]:
    """``(n, got)`` of one slot from the reduced host table (see :meth:`Sharding.reduce`): its
    element count and its value of every piece that some rank had (a NORM piece: its two norms)."""
    rows = host[1 + len(keys) * slot: 1 + len(keys) * (slot + 1)]
    n = float(round(rows[0][0]))  # the first key is "p", whose w·n sum over ranks is N
    got: dict[str, list[float]] = {}
    for (key, how), (a, b, c, present) in zip(keys.items(), rows):
        if not present:
            continue
        if how == MOMENTS:
            mean = b / n if n > 0 else 0.0
            got[key] = [mean, max(c - b * mean, 0.0)] if n > 0 else [0.0, 0.0]
        elif how == NORM:
            got[key] = [math.sqrt(max(a, 0.0)), math.sqrt(max(b, 0.0))]
        else:
            got[key] = [a]
    return n, got


class _LocalOptimizer:
    """What the monitor reads instead of a sharded optimizer (see ``Sharding.local``)."""

    def __init__(self, param_groups: list[dict[str, Any]], state: _LocalState, defaults: dict[str, Any]) -> None:
        self.param_groups = param_groups
        self.state = state
        self.defaults = defaults


class _LocalState:
    """``state`` of ``Sharding.local``: read-only, keyed by local shard, read at call time (the
    optimizer creates its state lazily during the first step)."""

    def __init__(self, sharding: Sharding) -> None:
        self._sharding = sharding

    def get(self, shard: Tensor, default: Any = None) -> Any:
        self._sharding.refresh_grad(shard)
        state = self._sharding._state.get(self._sharding.original(shard))
        return default if state is None else self._sharding.localize_state(shard, state)

    def __getitem__(self, shard: Tensor) -> Any:
        state = self.get(shard)
        if state is None:
            raise KeyError(shard)
        return state

    def __contains__(self, shard: object) -> bool:
        return isinstance(shard, Tensor) and self.get(shard) is not None


def _is_split(p: Tensor, zero: Any) -> bool:
    """Whether this rank holds only part of ``p`` (a sharded DTensor or an FSDP1 shard)."""
    if zero is not None:
        return False
    if _is_dtensor(p):
        return _dtensor_shards(p) > 1
    if getattr(p, "_fsdp_flattened", False):
        unit = _fsdp1_unit(p)
        return unit is not None and _fsdp1_shards(unit) > 1
    return False


def _is_dtensor(x: object) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(x, dtensor.DTensor)


def _dtensor_shards(p: Tensor) -> int:
    """Number of distinct shards of a DTensor: the product of the mesh sizes of its non-Replicate,
    non-Partial dimensions (``_StridedShard.is_shard()`` is False in torch 2.13, hence the negation)."""
    mesh = p.device_mesh
    return math.prod(mesh.size(d) for d, pl in enumerate(p.placements)
                     if not (pl.is_replicate() or pl.is_partial()))


def _dtensor_shard(p: Tensor) -> Tensor:
    """A plain alias of the DTensor's local tensor, with the grad laid out like ``p`` as its ``.grad``."""
    shard = p.to_local().detach()
    _set_local_grad(shard, p, None)
    return shard


def _set_local_grad(shard: Tensor, p: Tensor, valid: int | None) -> None:
    """``shard.grad`` = the local part of ``p.grad`` matching ``shard`` (``None`` without a grad).

    A DTensor grad laid out unlike ``p`` (a ``Partial`` sum) is redistributed to ``p``'s placements
    first: one collective, only then. ``valid`` narrows an FSDP1 flat shard's grad past its padding.

    Raises:
        RuntimeError: the local grad's shape differs from the local shard's.
    """
    g = p.grad
    if g is None:
        shard.grad = None
        return
    if _is_dtensor(g):
        if tuple(g.placements) != tuple(p.placements) or g.device_mesh != p.device_mesh:
            g = g.redistribute(p.device_mesh, _no_partial(p.placements))  # a collective: rare
        g = g.to_local()
        g = g.wait() if hasattr(g, "wait") else g
    g = g.detach() if valid is None else g.detach()[:valid]
    if g.shape != shard.shape:
        raise RuntimeError(f"monitored_optim: the local grad of a sharded parameter has shape "
                           f"{tuple(g.shape)}, its local shard {tuple(shard.shape)}")
    shard.grad = g


def _no_partial(placements: tuple[Any, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate

    return [Replicate() if pl.is_partial() else pl for pl in placements]


# ----- FSDP1 -------------------------------------------------------------------------------------

_FSDP1_UNITS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter (FlatParameter or one of its original-parameter views) -> its FSDP1 module."""
_NO_UNIT = object()


def _fsdp1_unit(p: Tensor) -> Any:
    """The ``FullyShardedDataParallel`` unit whose flat parameter holds ``p``, or ``None``.

    FSDP1 marks its flat parameters and, with ``use_orig_params=True``, the original parameters with
    ``_fsdp_flattened``; nothing points back from them, so the units are found once by a garbage
    collector scan (done again only when a new marked parameter appears).
    """
    unit = _FSDP1_UNITS.get(p)
    if unit is None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        for obj in gc.get_objects():  # type(), not isinstance(): no __class__ lookups (deprecation proxies warn)
            if issubclass(type(obj), FullyShardedDataParallel) and getattr(obj, "_handle", None) is not None:
                flat = obj._handle.flat_param
                _FSDP1_UNITS[flat] = obj
                for q in (getattr(flat, "_params", None) or []) + (getattr(flat, "_shared_params", None) or []):
                    _FSDP1_UNITS[q] = obj
        unit = _FSDP1_UNITS.setdefault(p, _NO_UNIT)  # not found: remembered, no scan at every step
    return None if unit is _NO_UNIT else unit


def _fsdp1_shards(unit: Any) -> int:
    """Distinct shards of an FSDP1 unit's parameters: its sharding group's size, 1 for ``NO_SHARD``."""
    from torch.distributed.fsdp import ShardingStrategy

    if unit.sharding_strategy == ShardingStrategy.NO_SHARD:
        return 1
    return unit.process_group.size()


# ----- ZeRO --------------------------------------------------------------------------------------

_ZERO_PARENT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _zero_parent(optimizer: torch.optim.Optimizer) -> Any:
    """The ``ZeroRedundancyOptimizer`` whose local (inner) optimizer is ``optimizer``, or ``None``.

    ZeRO builds its inner optimizer itself and keeps no reference the inner one could follow; its
    ``_local_step`` is on the call stack whenever it steps the inner optimizer, so the frame is found
    there once and remembered.
    """
    found = _ZERO_PARENT.get(optimizer)
    if found is not None:
        return found
    zero_mod = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero_mod is None:
        return None
    code = zero_mod.ZeroRedundancyOptimizer._local_step.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            owner = frame.f_locals.get("self")
            if getattr(owner, "optim", None) is optimizer:
                _ZERO_PARENT[optimizer] = owner
                return owner
        frame = frame.f_back
    return None


def _default_device() -> torch.device:
    """Where the table lives when a rank has no moment rows: the accelerator for NCCL-like backends."""
    backend = str(dist.get_backend()).lower()
    if "gloo" not in backend and "mpi" not in backend and torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


__all__ = ["Sharding", "initialized", "is_writer", "sharding"]

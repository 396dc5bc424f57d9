"""Pipeline stages: ranks that monitor different parameters, joined by name in one table.

Under pipeline parallelism (``torch.distributed.pipelining``, alone or with data-parallel replicas or
FSDP2 on a 2-D mesh) each rank monitors its stage's parameters only. The first time a monitor
reduces its figures, and again whenever a rank's parameter names change, the ranks exchange their
names once (one ``all_gather_object``): every rank then lays the table out over the union of
names, each rank's own first, and counts the ranks that monitor each name (its *holders*: the
replicas or shards of that parameter, :meth:`~.held.Held.weight`). Data and fully sharded
parallelism are the case where every rank monitors every name.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch.distributed as dist

from .._warnings import Once, warn


@dataclass(frozen=True)
class Remote:
    """A parameter another rank monitors: its name, shape and dtype (as that rank's figures need);
    ``whole``: the shape is the whole parameter's (not an FSDP1 shard's, which differs by rank)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    whole: bool = True


@dataclass(eq=False)
class Ranks:
    """The union of the names that the ranks monitor, as last exchanged (empty before the first).

    Two ranks that monitor parameters of one name but of different shapes or dtypes (stages built
    each as a model of its own, so that both have a ``0.weight``) hold different parameters: the
    second one is kept apart as ``{name}@rank{r}`` (r its first holder), and rank 0 warns once.

    Attributes:
        local: this rank's names at the exchange, in its order (None before the first).
        key: this rank's name -> its name in the union (itself, or ``{name}@rank{r}``).
        names: the union, this rank's parameters first, then the others in rank order.
        holders: union name -> number of ranks that monitor it.
        block: union name -> its block of rows in the table (in rank order, the same on every rank).
        remote: the union's parameters that this rank does not monitor, as :class:`Remote`, in order.
        fingerprint: a checksum of the union (the same on every rank), as a float.
        left_out: the heads of the piece keys the reduction left out and warned about.
    """

    local: tuple[str, ...] | None = None
    key: dict[str, str] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    holders: dict[str, int] = field(default_factory=dict)
    block: dict[str, int] = field(default_factory=dict)
    remote: list[Remote] = field(default_factory=list)
    fingerprint: float = 0.0
    left_out: Once = field(default_factory=Once)

    def exchange(self, local: list[Remote]) -> None:
        """Exchange this rank's names with every rank (one ``all_gather_object``; call on every rank)."""
        gathered: list[list[Remote] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(local))
        everyone: dict[str, Remote] = {}
        variants: dict[str, list[str]] = {}  # name -> the union names of its shapes
        keys: list[dict[str, str]] = []
        self.holders = {}
        for rank, held in enumerate(gathered):
            keys.append({})
            for r in held or []:
                key = next((k for k in variants.get(r.name, []) if _same(everyone[k], r)), None)
                if key is None:
                    key = r.name if r.name not in variants else f"{r.name}@rank{rank}"
                    variants.setdefault(r.name, []).append(key)
                    everyone[key] = Remote(key, r.shape, r.dtype, r.whole)
                self.holders[key] = self.holders.get(key, 0) + 1
                keys[rank][r.name] = key
        self.block = {name: i for i, name in enumerate(everyone)}
        self.local = tuple(r.name for r in local)
        self.key = keys[dist.get_rank()]
        mine = {self.key[name] for name in self.local}
        self.remote = [r for name, r in everyone.items() if name not in mine]
        self.names = [*(self.key[name] for name in self.local), *(r.name for r in self.remote)]
        self.fingerprint = float(zlib.crc32("\n".join(everyone).encode()) & 0xFFFF)
        apart = {name: keys for name, keys in variants.items() if len(keys) > 1}
        if apart and dist.get_rank() == 0:
            shown = "; ".join(f"{', '.join(map(repr, keys))} ({', '.join(str(list(everyone[k].shape)) for k in keys)})"
                              for keys in apart.values())
            warn(f"monitored_optim: ranks monitor different parameters under one name, kept apart as {shown}; build "
                 "each pipeline stage from the whole model so that its parameters keep the model's full names",
                 RuntimeWarning)


def _same(a: Remote, b: Remote) -> bool:
    """Whether two ranks' parameters of one name can be the same one (a shape not known whole matches any)."""
    return a.dtype == b.dtype and (a.shape == b.shape or not (a.whole and b.whole))

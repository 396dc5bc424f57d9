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


@dataclass(frozen=True)
class Remote:
    """A parameter another rank monitors: its name, shape and dtype (as that rank's figures need)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(eq=False)
class Ranks:
    """The union of the names that the ranks monitor, as last exchanged (empty before the first).

    Attributes:
        local: this rank's names at the exchange, in its order (None before the first).
        names: the union, this rank's names first, then the others in rank order.
        holders: name -> number of ranks that monitor it.
        block: name -> its block of rows in the table (the union in rank order, the same on every rank).
        remote: the union's names that this rank does not monitor, as :class:`Remote`, in order.
        fingerprint: a checksum of the union (the same on every rank), as a float.
    """

    local: tuple[str, ...] | None = None
    names: list[str] = field(default_factory=list)
    holders: dict[str, int] = field(default_factory=dict)
    block: dict[str, int] = field(default_factory=dict)
    remote: list[Remote] = field(default_factory=list)
    fingerprint: float = 0.0

    def exchange(self, local: list[Remote]) -> None:
        """Exchange this rank's names with every rank (one ``all_gather_object``; call on every rank)."""
        gathered: list[list[Remote] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(local))
        everyone: dict[str, Remote] = {}
        self.holders = {}
        for held in gathered:
            for r in held or []:
                everyone.setdefault(r.name, r)
                self.holders[r.name] = self.holders.get(r.name, 0) + 1
        self.block = {name: i for i, name in enumerate(everyone)}
        self.local = tuple(r.name for r in local)
        mine = set(self.local)
        self.remote = [r for name, r in everyone.items() if name not in mine]
        self.names = [*self.local, *(r.name for r in self.remote)]
        self.fingerprint = float(zlib.crc32("\n".join(everyone).encode()) & 0xFFFF)

"""The reduce stage: a logging step's values brought to the host, in one copy or one collective.

One row per monitored parameter: the ``(mean, m2)`` of each kind of :data:`~monitored_optim.stats.KINDS`
(p_before, grad, u) as they come back from the device in one copy (or from the one collective,
:mod:`monitored_optim.distributed`), made into a :class:`~monitored_optim.hosted.MomentTable`, and the
host values of the other pieces (:mod:`monitored_optim.pieces`), as a :class:`~monitored_optim.hosted.Hosted`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .hosted import Hosted, table

if TYPE_CHECKING:
    from .capture.plan import Entries, Roster, Stepped
    from .distributed import Gathered, Sharding, Unsharded
    from .distributed.pipeline import Ranks
    from .pieces import Keys
    from .stats import Moments


def gather(entries: Entries, roster: Roster, rows: Moments, source: Stepped, sharding: Sharding | Unsharded,
           keys: Keys, ranks: Ranks, cost: tuple[float, float] = (0.0, 0.0)
           ) -> tuple[Hosted, Gathered, dict[int, list[float]]]:
    """A logging step's values on the host: one device-to-host copy per device, or under
    ``torch.distributed`` one all_reduce (and one host copy for Tensor learning rates), as the
    step's layout reduces them (:meth:`~monitored_optim.distributed.Sharding.reduce`).

    Args:
        entries, roster: the step's entries and parameters.
        rows: the batch's moments (:meth:`~monitored_optim.stats.Batch.finish`).
        source: the optimizer whose param groups carry every learning rate (its Tensor ones are read,
            :func:`tensor_lrs`).
        sharding: the step's layout (:func:`~monitored_optim.distributed.sharding`).
        keys, ranks, cost: every piece key -> its reduction (the sharded table's rows), the union of
            the ranks' names and this rank's ``(bytes copied, host seconds)``
            (:func:`~monitored_optim.distributed.table.reduce`).

    Returns:
        ``(hosted, gathered, lrs)``: the step's :class:`~monitored_optim.hosted.Hosted` (under
        ``torch.distributed`` over the union of the ranks' parameters, this rank's first), what the
        layout gathered (the other ranks' parameters, the cost over the ranks), and param group index ->
        the value of its Tensor learning rate (``[float]``).
    """
    leads = entries.leads
    lr_values = tensor_lrs(source)
    got = sharding.reduce(leads, rows, roster.index, list(lr_values.values()), keys, ranks, cost)
    return Hosted(table(leads, roster.captured, got.counts, got.pairs, got.present), got.pieces), got, \
        dict(zip(lr_values, got.read))


def tensor_lrs(optimizer: Stepped) -> dict[int, Tensor]:
    """Index -> lr of each param group whose lr is a Tensor, for the logging step's host copy.

    Each is a 1-D float64 tensor of one element on its device."""
    return {i: group["lr"].detach().reshape(1).double() for i, group in enumerate(optimizer.param_groups)
            if isinstance(group.get("lr"), Tensor)}

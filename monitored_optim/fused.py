"""Fused capture: a chunk's stored changes and their sums in one compiled function.

On a logging step the eager capture runs a dozen small ops per parameter (rebuild, inversion,
centring, sums), so its cost follows the number of tensors. The fused path hands a chunk of up to
:data:`CHUNK` parameters of one param group, device, dtype and kind to one function that

* rebuilds each update from the optimizer's state (the view's ``fused`` form, e.g. Adam's
  d = c·m / (sqrt(v) + eps·b)), inverts the rounding of the store,
  p_before = fl(fl(p_after - d) / s), u = p_after - p_before (``capture.stored_change``'s rule), or
  takes p_before from the snapshot of the snapshot rule (vectors, near-constant matrices);
* reduces p_before (before the step, :func:`prior`), the grad and u to one-pass *shifted* sums
  accumulated in float64: with c the
  tensor's first element, ``(c, Σ(x - c), sqrt(Σ(x - c)^2))``, from which
  ``stats.Batch`` takes mean = c + Σ(x - c)/n and m2 = Σ(x - c)^2 - (Σ(x - c))^2/n. Shifting by a
  value of the tensor keeps the spread of a LayerNorm weight near 1.0 with std 1e-4 (the
  shifted-data algorithm, Chan, Golub & LeVeque 1983); float64 accumulation keeps the sums of
  large tensors exact to about 1e-16 per element.

:func:`torch.compile` (inductor) fuses each function into a few kernels that read p, grad and
state once and write nothing of parameter size; shapes are dynamic, so chunks with the same count,
kinds and ranks (identical transformer blocks) share one compiled graph. Where compiling fails the
same function runs eagerly (a warning, once), which gives the same figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors

from . import capture
from ._warnings import warn

CHUNK = 32
"""Most parameters handed to one call: larger chunks mean fewer calls but longer compiles (inductor's
compile time grows with the graph)."""

RECOMPILES = 64
"""Graphs kept per fused function (one per chunk signature: count, ranks, kind, rebuild); Dynamo's
default of 8 would send a model with many signatures (conv nets) back to eager."""


def enabled(mode: str, device: torch.device) -> bool:
    """Whether the fused path runs for parameters on ``device`` under ``MonitorConfig(compile=mode)``.

    ``auto`` fuses on CUDA only: there every small op of the eager capture is a kernel launch, while
    on a CPU the first logging step's compile (39 s for the benchmark's 75-tensor model on 2 cores
    with an empty inductor cache, 3 s from the cache in a later process; README "Cost") is worth it
    only over thousands of logging steps."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


SMALL = 1 << 12
"""Elements up to which a parameter is captured *flat* (eagerly, compiling or not: measured faster on a
CPU, 0.16 against 0.6 ms for 49 vectors): copied whole into one flat
buffer with the other small parameters of its chunk before the step (its exact snapshot), so that a
chunk of thousands of biases and norm gains costs a few ops, not a few per tensor."""

FLAT = 1 << 14
"""Most elements of one flat chunk (its float64 temporaries stay a few MiB)."""


def flat_chunks(sizes: Sequence[int]) -> list[range]:
    """The flat chunks of parameters of ``sizes`` elements, in order: greedy consecutive runs of at
    most :data:`FLAT` elements in all (a single parameter of more would make a chunk of its own).

    Args:
        sizes: element counts (ints), one per parameter.

    Returns:
        Ranges of indices into ``sizes`` covering ``range(len(sizes))`` in order (empty for none).
    """
    chunks, start, size = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and size + n > FLAT:
            chunks.append(range(start, i))
            start, size = i, 0
        size += n
    if len(sizes) > start:
        chunks.append(range(start, len(sizes)))
    return chunks


def flat_copy(tensors: list[Tensor]) -> Tensor:
    """``tensors`` laid end to end in a new buffer: a flat chunk's p_before.

    Args:
        tensors: a non-empty list of dense tensors of one dtype and device (any shapes).

    Returns:
        A new 1-D tensor of their dtype with ``sum(t.numel())`` elements, never a view of one of
        them (``_flatten_dense_tensors`` returns a view of a single tensor, which the step would
        change under the snapshot).
    """
    return _flatten_dense_tensors(tensors) if len(tensors) > 1 else tensors[0].reshape(-1).clone()


def segment_rows(x: Tensor, lengths: Tensor) -> Tensor:
    """:func:`shifted_rows` of the consecutive segments of a flat tensor.

    Args:
        x: 1-D real floating tensor, the segments laid end to end.
        lengths: int64 tensor of shape ``(k,)`` on ``x``'s device, positive, summing to ``x.numel()``.

    Returns:
        Float64 tensor of shape ``(k, 3)``: per segment ``(c, Σ(x - c), sqrt(Σ(x - c)^2))``, c its
        first element.
    """
    x = x.double()
    shift = x[lengths.cumsum(0) - lengths]
    y = x - shift.repeat_interleave(lengths, output_size=x.numel())
    return torch.stack([shift, torch.segment_reduce(y, "sum", lengths=lengths),
                        torch.segment_reduce(y * y, "sum", lengths=lengths).sqrt()], 1)


def flat(before: Tensor, after: Tensor, grads: Tensor, lengths: Tensor) -> Tensor:
    """Rows of p_before, grad and u = p_after - p_before of a flat chunk.

    Args:
        before, after, grads: 1-D float32/float64 tensors of one length, the chunk's parameters
            before the step, after it and their grads laid end to end (``lengths`` apart).
        lengths: see :func:`segment_rows`.

    Returns:
        Float64 tensor of shape ``(3, k, 3)``; u is formed in float64 (exact also where it crosses 0).
    """
    return torch.stack([segment_rows(before, lengths), segment_rows(grads, lengths),
                        segment_rows(after.double() - before.double(), lengths)])


def shifted_rows(xs: Sequence[Tensor]) -> Tensor:
    """``(c, Σ(x - c), sqrt(Σ(x - c)^2))`` per tensor, c its first element, accumulated in float64.

    Args:
        xs: non-empty real floating tensors (any shapes, one device).

    Returns:
        Float64 tensor of shape ``(len(xs), 3)`` on their device (the centred rows of
        :class:`~monitored_optim.stats.Batch`).
    """
    rows = []
    for x in xs:
        flat = x.reshape(-1).double()
        shift = flat[0]
        y = flat - shift
        rows.append(torch.stack([shift, y.sum(), y.square().sum().sqrt()]))
    return torch.stack(rows)


def prior(xs: list[Tensor]) -> Tensor:
    """Before the step, in one pass: per tensor ``[min, max, c, Σ(x - c), sqrt(Σ(x - c)^2), exact]`` in
    float64, shape ``(k, 6)``: the bounds (where they are equal, a matrix initialised at 0, p_before
    is that value exactly, ``capture.bounds``), the :func:`shifted_rows` of p_before, taken here
    because p_after - u cannot give p_before where the step made p non-finite, and
    :func:`~monitored_optim.capture.at_powers_of_two` of p_before. Inductor fuses all six into one
    loop per tensor (the benchmark's 26 matrices: 26 parallel regions, 76 when the power-of-two test
    read x's bits and the bounds ran over each tensor's own shape; 0.88 against 1.11 to 1.43 ms a
    call, repeated from cache; 1.11 against 1.61 ms inside logging steps): each tensor's reductions
    are traced together, over its flat view, as inductor fuses only nodes close in the graph and of
    one loop shape."""
    rows = []
    for x in xs:
        flat = x.reshape(-1)
        rows.append(torch.cat([torch.stack([flat.min(), flat.max()]).double(), shifted_rows([flat])[0],
                               capture.at_powers_of_two(flat, flat)]))
    return torch.stack(rows)


def inverted(rebuild: Callable[..., list[Tensor]], args: tuple[Any, ...], factors: Tensor, s: Tensor | None,
             extremes: Tensor, after: list[Tensor], grads: list[Tensor]) -> Tensor:
    """Rows of the grad and u of parameters whose update is rebuilt from state.

    Args:
        rebuild: a view's fused form: ``rebuild(*args)`` gives one tensor r per parameter with
            d = factor·r the update the step added (``Scaled(r, factor)``).
        factors: float64 tensor of shape ``(k,)``.
        s: the decoupled-decay factor 1 - lr·λ (a 0-dim tensor: p ← s·p before the add), or None.
        extremes: the bounds of the parameters before the step (:func:`prior`), float64 ``(k, 2)``.
        after: the k parameters after the step (float32/float64, each with its grad in ``grads``).

    Returns:
        Float64 tensor of shape ``(2, k, 3)``: :func:`shifted_rows` of the grad and of u (those of
        p_before come from :func:`prior`).
    """
    changes = []
    for p, r, f, (lo, hi) in zip(after, rebuild(*args), factors.unbind(), extremes.unbind()):
        b = p - (r * f).to(p.dtype)  # the nearest value to p - d, rounded in p's dtype
        b = b if s is None else b / s.to(p.dtype)
        b = torch.where(lo == hi, lo.to(p.dtype), b)  # a constant is recovered exactly
        changes.append(p - b)  # exact (Sterbenz)
    return grad_and_change_rows(grads, changes)


def grad_and_change_rows(grads: list[Tensor], changes: list[Tensor]) -> Tensor:
    """:func:`shifted_rows` of k grads and of k stored changes u, float64 of shape ``(2, k, 3)``."""
    return torch.stack([shifted_rows(grads), shifted_rows(changes)])


def snapshotted(before: list[Tensor], after: list[Tensor], grads: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Rows of p_before, grad and u = p_after - p_before of parameters with an exact snapshot, float64
    of shape ``(3, k, 3)``, and their :func:`~monitored_optim.capture.at_powers_of_two` (``(k,)``)."""
    rows = [shifted_rows(before), shifted_rows(grads), shifted_rows([p - b for p, b in zip(after, before)])]
    return torch.stack(rows), torch.cat([capture.at_powers_of_two(b, p) for p, b in zip(after, before)])


def copied(xs: list[Tensor]) -> list[Tensor]:
    """Exact copies of ``xs`` (the snapshot rule's p_before of a chunk), one kernel for all when compiled."""
    return [x.clone() for x in xs]


INDUCTOR = {"realize_reads_threshold": 64, "realize_opcount_threshold": 1000, "realize_cpu_opcount_threshold": 1000,
            "cpp.enable_unsafe_math_opt_flag": False}
"""Inductor recomputes each element's p_before and u in every sum that reads it rather than storing
them: with its default thresholds it keeps parameter-sized buffers for them (measured: 31% of the
parameter bytes of the benchmark's model at once), the memory the fused capture exists to save. Its
C++ keeps IEEE float semantics whatever the user's inductor settings: the inversion of the store and
:func:`~monitored_optim.capture.mantissa_gap` rely on each rounding (``-funsafe-math-optimizations``,
``TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG=1``, made the power-of-two sums 0, figures 1.8% off,
and switches the whole process to flush subnormals to zero)."""


class Fuser:
    """The fused capture's functions of one monitor under ``MonitorConfig(compile=mode)``: compiled
    where :func:`enabled`, eager elsewhere, and back to eager where compiling fails (warned once;
    the same figures, at the eager speed)."""

    def __init__(self, mode: str = "auto") -> None:
        self.mode = mode
        self._compiled: dict[str, Callable[..., Tensor]] = {}
        self._failed = False

    def __call__(self, fn: Callable[..., Tensor], *args: Any, device: torch.device) -> Any:
        """``fn(*args)``, compiled (dynamic shapes) where :func:`enabled` for ``device``, else or after
        a failure eagerly."""
        if enabled(self.mode, device) and not self._failed:
            compiled = self._compiled.get(fn.__name__)
            if compiled is None:
                compiled = self._compiled[fn.__name__] = torch.compile(fn, dynamic=True, options=INDUCTOR)
            try:
                with torch._dynamo.config.patch(recompile_limit=RECOMPILES):
                    return compiled(*args)
            except Exception as err:  # noqa: BLE001 - any compiler failure: run eagerly instead
                self._failed = True
                warn(f"monitored_optim: compiling the fused capture failed ({type(err).__name__}: "
                     f"{str(err).splitlines()[0] if str(err) else ''}); it runs eagerly from now on, with the same "
                     "figures; MonitorConfig(compile=False) or MONITORED_OPTIM_COMPILE=0 uses the eager capture",
                     RuntimeWarning)
        return fn(*args)

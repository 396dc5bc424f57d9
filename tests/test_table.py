"""The sharded logging step's one collective, in one process: each rank's table built on its own
(:func:`monitored_optim.distributed.table.build`), the tables summed as ``all_reduce(SUM)`` sums
them, and read back (:func:`~monitored_optim.distributed.table.gathered`), against the figures of
the whole tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from monitored_optim import stats
from monitored_optim.distributed.held import Held
from monitored_optim.distributed.pipeline import Ranks
from monitored_optim.distributed.table import HEADER, build, gathered
from monitored_optim.pieces import CORE, MAX, MIN, SUM, WHOLE, Keys

KEYS = Keys({**CORE, "top:p": WHOLE, "min:u": MIN, "max:u": MAX, "bins:u": SUM}, {"bins:u": 5})
EDGES = torch.tensor([-math.inf, -1e-6, -1e-8, 1e-8, 1e-6, math.inf], dtype=torch.float64)


@dataclass
class Entry:
    """What the table reads of a capture's lead entry: its name, its local tensor and its pieces."""

    name: str
    p: torch.Tensor
    pieces: dict[str, torch.Tensor] = field(default_factory=dict)


def _bins(u: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(u.double().reshape(-1), EDGES[1:-1]).bincount(minlength=5).double()


def _pieces(p: torch.Tensor, u: torch.Tensor, grad: torch.Tensor | None, whole: torch.Tensor | None) -> dict:
    """The pieces a rank's capture makes of what it holds: p_before ``p``, the stored change ``u``."""
    out = {"p": stats.moments(p), "u": stats.moments(u), "lost": (u == 0).sum().double().reshape(1),
           "verify": torch.stack([torch.linalg.vector_norm(u.double()), torch.linalg.vector_norm(p.double())]),
           "min:u": u.double().min().reshape(1), "max:u": u.double().max().reshape(1), "bins:u": _bins(u)}
    if grad is not None:
        out["grad"] = stats.moments(grad)
    if whole is not None:  # a value of the whole tensor (a spectral figure's kind)
        out["top:p"] = torch.linalg.matrix_norm(whole.double(), ord=2).reshape(1)
    return out


def _truth(p: torch.Tensor, u: torch.Tensor) -> dict:
    x, d = p.double().reshape(-1), u.double().reshape(-1)
    return {"n": float(x.numel()), "p": (x.mean().item(), (x - x.mean()).square().sum().item()),
            "u": (d.mean().item(), (d - d.mean()).square().sum().item()), "lost": float((d == 0).sum()),
            "verify": (torch.linalg.vector_norm(d).item(), torch.linalg.vector_norm(x).item()),
            "min:u": d.min().item(), "max:u": d.max().item(), "bins:u": _bins(u).tolist()}


def _tensors(dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """p_before and u of the tensors real models have: a LayerNorm weight at 1.0 with a small spread,
    a bias at 0, a matrix; each u a warmup-sized change, some elements unchanged."""
    g = torch.Generator().manual_seed(0)
    norm = (1.0 + 1e-3 * torch.randn(1000, generator=g)).to(dtype)
    bias = torch.zeros(16, dtype=dtype)
    matrix = (0.02 * torch.randn(12, 10, generator=g)).to(dtype)
    out = {}
    head = (0.01 * torch.randn(8, generator=g)).to(dtype)
    for name, p in (("norm.weight", norm), ("bias", bias), ("fc.weight", matrix), ("head.bias", head)):
        u = (1e-7 * torch.randn(p.shape, generator=g)).to(dtype)
        u.reshape(-1)[::7] = 0
        out[name] = (p, u)
    return out


def _ranks(world: int, names: list[list[str]], rank: int) -> Ranks:
    """Rank ``rank``'s :class:`Ranks` after the exchange: the union in rank order, a block each."""
    union = list(dict.fromkeys(n for held in names for n in held))
    holders = {n: sum(n in held for held in names) for n in union}
    own = names[rank]
    ordered = own + [n for n in union if n not in own]
    return Ranks(local=tuple(own), key={n: n for n in own}, names=ordered, holders=holders,
                 block={n: i for i, n in enumerate(union)}, fingerprint=0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_summed_tables_give_the_whole_tensors_figures(world, dtype):
    """``norm.weight`` split in uneven shards over the ranks (its WHOLE piece left out), ``bias``
    replicated on every rank (each copy weighs 1/world), ``fc.weight`` held whole by the last rank
    alone (a pipeline stage's), ``head.bias`` on every rank under torch's ZeRO, stepped by rank 0 alone
    (the others' unchanged copies weigh 0); rank 0 has no grad of ``norm.weight``. The table gives each
    one's element count, moments, counts, norms, least and greatest value and bins of the whole tensor."""
    tensors = _tensors(dtype)
    norm_p, norm_u = tensors["norm.weight"]
    cuts = [0, *[(1000 * (r + 1) * (r + 2)) // (world * (world + 1)) for r in range(world)]]  # uneven shards
    names = [["norm.weight", "bias", "head.bias"] + (["fc.weight"] if r == world - 1 else []) for r in range(world)]
    tables, left_out = [], set()
    for r in range(world):
        ranks = _ranks(world, names, r)
        lo, hi = cuts[r], cuts[r + 1]
        entries = [Entry("norm.weight", norm_p[lo:hi],
                         _pieces(norm_p[lo:hi], norm_u[lo:hi], None if r == 0 else norm_u[lo:hi], norm_p[None, lo:hi])),
                   Entry("bias", tensors["bias"][0], _pieces(*tensors["bias"], tensors["bias"][1], None))]
        held = [Held(norm_p[lo:hi], norm_p, shards=world, split=world > 1),
                Held(tensors["bias"][0], tensors["bias"][0], 1)]
        p, u = tensors["head.bias"]
        owner = r == 0  # whatever a non-owner's copy holds weighs 0 (its extremes too)
        entries.append(Entry("head.bias", p, _pieces(p, u if owner else -3 * u, u, None)))
        held.append(Held(p, p, shards=world if owner else 0))
        if "fc.weight" in names[r]:
            p, u = tensors["fc.weight"]
            entries.append(Entry("fc.weight", p, _pieces(p, u, u, p)))
            held.append(Held(p, p, shards=None))
        tables.append(build(entries, held, KEYS, ranks, False, left_out, (100.0, 0.5), world, r, torch.device("cpu")))
    host = torch.stack(tables).sum(0).tolist()  # what all_reduce(SUM) leaves on every rank
    assert host[0][:3] == [world, world * 0.25, world * 0.25 ** 2] and host[1][:3] == [0.0, 100.0 * world, 0.5 * world]
    reduced = gathered(host, _ranks(world, names, 0), KEYS, world)
    assert reduced.names == ["norm.weight", "bias", "head.bias", "fc.weight"]
    for i, name in enumerate(reduced.names):
        truth = _truth(*tensors[name])
        got = reduced.pieces[i]
        assert reduced.counts[i] == truth["n"]
        for k, kind in enumerate(stats.KINDS):
            if kind == "grad":
                continue
            mean, m2 = reduced.pairs[i, k].tolist()
            spread = math.sqrt(truth[kind][1] / truth["n"])  # each shard's float32 mean is within ~eps of it
            assert mean == pytest.approx(truth[kind][0], rel=1e-6, abs=1e-6 * spread + 1e-30)
            assert m2 == pytest.approx(truth[kind][1], rel=2e-5, abs=1e-30)
        assert got["lost"] == pytest.approx([truth["lost"]], rel=1e-12)  # a replica's count weighs 1/world
        assert got["bins:u"] == pytest.approx(truth["bins:u"], rel=1e-12)
        assert got["verify"] == pytest.approx(list(truth["verify"]), rel=1e-12)
        assert got["min:u"] == [truth["min:u"]] and got["max:u"] == [truth["max:u"]]
    grad = stats.KINDS.index("grad")
    assert reduced.present[:, grad].tolist() == [world > 1, True, True, True]  # rank 0 alone had no grad of norm.weight
    shards = [norm_u[cuts[r]:cuts[r + 1]].double() for r in range(1, world)]
    if shards:
        d = torch.cat(shards)
        mean, m2 = reduced.pairs[0, grad].tolist()  # a rank without it counts as zeros there
        assert mean == pytest.approx(d.sum().item() / 1000, rel=1e-6)
        assert m2 == pytest.approx((d.square().sum() - d.sum() ** 2 / 1000).item(), rel=1e-5)
    whole = torch.linalg.matrix_norm(norm_p[None].double(), ord=2).item()
    assert ("top:p" in reduced.pieces[0]) == (world == 1) and ("top:p" in left_out) == (world > 1)
    if world == 1:
        assert reduced.pieces[0]["top:p"] == pytest.approx([whole], rel=1e-12)
    fc = tensors["fc.weight"][0]
    assert reduced.pieces[3]["top:p"] == pytest.approx([torch.linalg.matrix_norm(fc.double(), ord=2).item()], rel=1e-12)
    assert "top:p" not in reduced.pieces[1] and "top:p" not in reduced.pieces[2]


def test_a_rank_whose_names_changed_sends_its_header_alone():
    """A rank that monitors other names than at the exchange writes nothing in the blocks (and says so
    in the header, so that every rank exchanges again)."""
    p, u = _tensors(torch.float32)["bias"]
    ranks = _ranks(1, [["bias"]], 0)
    table = build([Entry("bias", p, _pieces(p, u, u, None))], [Held(p, p, 1)], KEYS, ranks, True, set(),
                  (0.0, 0.0), 1, 0, torch.device("cpu"))
    assert table[1, 0].item() == 1.0
    blocks = table[HEADER:]
    assert torch.isneginf(blocks).sum().item() == 2  # the rank's own slots of min:u and max:u: none
    assert blocks[torch.isfinite(blocks)].abs().sum().item() == 0.0

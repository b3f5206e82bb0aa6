"""Which chunks of ``sparseloco`` a rank packs, and the pieces it trades with its replica's other ranks.

The contract cuts each parameter tensor into chunks of ``chunk`` consecutive elements, never spanning two
tensors; ZeRO-1 cuts the replica's flat buffer into ``k`` equal partitions of ``P`` elements, whatever
the tensors. A chunk may therefore straddle two (or more) ranks' partitions. The rule here, exact
whatever the sharding:

* a chunk belongs to the rank whose partition holds its **first** element (its *owner*);
* the other ranks holding part of it send those elements (their *head*: the start of their partition,
  up to the first chunk they own) of the error buffer to the owner before the top-k, and take back the
  residual and the averaged update of those elements after it.

So every rank's error buffer, anchor and master shard keep ZeRO-1's layout (checkpoints and resharding
read them like the masters), and the owner packs whole chunks: the same selection as one process
holding the whole tensor. ``ChunkPlan`` is pure arithmetic on sizes and offsets, the same on every rank.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass
class ChunkPlan:
    """One rank's share of one flat parameter group (offsets relative to its partition's start)."""
    partition: int  # P, elements of each rank's partition
    own_lo: int  # the owned chunks cover [own_lo, own_hi) (own_hi may pass P: the last one's tail)
    own_hi: int
    offsets: torch.Tensor  # int64 chunk boundaries of the owned chunks, relative to own_lo (ops.reference)
    head: int  # elements at this partition's start that belong to an earlier rank's chunk
    head_owner: int  # the rank (index in the replica) owning them; -1: no head
    tails: List[Tuple[int, int]]  # (rank, elements) of the heads this rank receives, in rank order

    @property
    def chunks(self) -> int:
        return self.offsets.numel() - 1 if self.offsets.numel() else 0

    @property
    def extended(self) -> int:
        """Elements of the partition plus the received tails (the buffer the owner packs from)."""
        return self.partition + sum(n for _, n in self.tails)


def chunk_bounds(params: Sequence[Tuple[int, int]], chunk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(starts, ends) of every chunk of a flat group, from its ``(numel, offset)`` parameters."""
    starts, ends = [], []
    for n, offset in params:
        if n == 0:
            continue
        s = torch.arange(offset, offset + n, chunk, dtype=torch.int64)
        starts.append(s)
        ends.append((s + chunk).clamp(max=offset + n))
    if not starts:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    order = torch.argsort(torch.cat(starts))
    return torch.cat(starts)[order], torch.cat(ends)[order]


def _straddling(starts: torch.Tensor, ends: torch.Tensor, point: int) -> Optional[int]:
    """The chunk with start < point < end, if any."""
    j = int(torch.searchsorted(starts, torch.tensor([point]), right=True)[0]) - 1
    return j if j >= 0 and int(starts[j]) < point < int(ends[j]) else None


def chunk_plan(params: Sequence[Tuple[int, int]], partition: int, k: int, shard: int, chunk: int,
               layout: Optional[Sequence[Tuple[int, int]]] = None) -> ChunkPlan:
    """This rank's ``ChunkPlan`` for a group of ``(numel, offset)`` parameters split into ``k`` partitions
    of ``partition`` elements, rank ``shard`` holding ``[shard * partition, (shard + 1) * partition)``;
    ``layout``: per rank ``(start, size)`` instead (FSDP2's uneven dim-0 shards of one parameter)."""
    starts, ends = chunk_bounds(params, chunk)
    layout = list(layout) if layout is not None else [(t * partition, partition) for t in range(k)]

    def holder(point: int) -> int:
        return next(t for t, (a, n) in enumerate(layout) if a <= point < a + n)

    heads = []  # per rank: (owner, elements) of its head, or None
    for a, n in layout:
        j = _straddling(starts, ends, a) if n else None
        heads.append(None if j is None else (holder(int(starts[j])), min(int(ends[j]), a + n) - a))
    base, P = layout[shard]
    owned = (starts >= base) & (starts < base + P)
    own_s, own_e = starts[owned], ends[owned]
    if own_s.numel() and not torch.equal(own_e[:-1], own_s[1:]):
        raise ValueError("sparseloco: the parameters of a flat group are not laid end to end (a gap between two "
                         "of them inside one rank's partition); the chunk layout needs contiguous parameters")
    lo = int(own_s[0]) - base if own_s.numel() else 0
    hi = int(own_e[-1]) - base if own_s.numel() else 0
    offsets = torch.cat([own_s, own_e[-1:]]) - base - lo if own_s.numel() else torch.zeros(0, dtype=torch.int64)
    head_owner, head = heads[shard] if heads[shard] is not None else (-1, 0)
    tails = [(t, h[1]) for t, h in enumerate(heads) if h is not None and h[0] == shard and t != shard]
    plan = ChunkPlan(P, lo, hi, offsets, head, head_owner, tails)
    if own_s.numel() and max(P, hi) != plan.extended:
        raise AssertionError(f"sparseloco chunk plan: owned chunks end at {hi} but partition + tails = {plan.extended}")
    return plan


__all__ = ["ChunkPlan", "chunk_plan", "chunk_bounds"]

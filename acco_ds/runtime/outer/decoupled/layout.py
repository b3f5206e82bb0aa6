"""Where each element of a learner's model lives at the syncer, whatever the learner's size.

A learner of ``k`` data-parallel ranks holds its model (at one model-parallel position) as ZeRO-1 partitions: for
every parameter group ``g`` of ``n_g`` elements, rank ``p`` holds elements ``[p w_g, (p + 1) w_g)`` of the group's
flat buffer, ``w_g`` its partition width (the buffer is padded at the end to ``k w_g``). Its *part* is those
ranges of every group, end to end (``Parts``). The syncer cuts the same model the same way into its own ``S``
parts, one per shard, with DeepSpeed's width rule for ``S`` ranks (``part_width``), fixed when it starts: it shards
the model, not the learners. A learner whose partitions are the syncer's parts (``k = S``) sends each rank's part
as it is. Any other learner moves its pseudo-gradient into the syncer's parts, and θ_g back, inside the learner
(``Relayout``: one all-to-all over its ranks): syncer part ``i`` is sent and received by learner rank ``i mod k``,
which holds the link to shard ``i``. Each element crosses to the syncer once either way, from whichever learner
rank holds it. Positions past ``n_g`` are padding: zero in a Δ sent, ignored in a θ_g received.
"""

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.distributed as tdist


def part_width(numel: int, parts: int) -> int:
    """DeepSpeed ZeRO-1's partition width of a group of ``numel`` elements over ``parts`` ranks: the group is padded
    to a multiple of ``2 parts`` (``nccl_start_alignment_factor``, 2 for 16-bit weights)."""
    return -(-numel // (2 * parts)) * 2


@dataclass(frozen=True)
class Parts:
    """A model of groups of ``sizes[g]`` elements, each cut into ``count`` parts of ``widths[g]`` elements."""

    sizes: Tuple[int, ...]
    widths: Tuple[int, ...]
    count: int

    @classmethod
    def syncer(cls, sizes: Sequence[int], count: int) -> "Parts":
        return cls(tuple(sizes), tuple(part_width(n, count) for n in sizes), count)

    @property
    def numel(self) -> int:
        """The elements of one part (padding included): the length of a slice at the syncer."""
        return sum(self.widths)

    def offset(self, g: int) -> int:
        """Where group ``g`` starts inside a part."""
        return sum(self.widths[:g])


def moves(src: Parts, dst: Parts) -> List[Tuple[int, int, int, int, int]]:
    """Every run of elements that is in one part of ``src`` and one part of ``dst``, in a fixed order:
    ``(src_part, src_offset, dst_part, dst_offset, length)``, offsets inside the parts."""
    if src.sizes != dst.sizes:
        raise ValueError(f"groups of {list(src.sizes)} elements cannot be laid out as groups of {list(dst.sizes)}")
    out = []
    for g, n in enumerate(src.sizes):
        ws, wd, s0, d0 = src.widths[g], dst.widths[g], src.offset(g), dst.offset(g)
        for i in range(dst.count):
            lo, hi = i * wd, min((i + 1) * wd, n)
            p = lo // ws if ws else 0
            while lo < hi:
                top = min(hi, (p + 1) * ws)
                out.append((p, s0 + lo - p * ws, i, d0 + lo - i * wd, top - lo))
                lo, p = top, p + 1
    return out


class Relayout:
    """Moves this rank's part of a learner laid out as ``mine`` (``rank`` of ``mine.count``, over ``group``) into
    the syncer parts it holds (``owned``: those ``i`` with ``i mod k = rank``), and back. ``same``: the two layouts
    are one (each rank holds its own part): nothing moves."""

    def __init__(self, mine: Parts, syncer: Parts, rank: int, group=None, device="cpu"):
        self.mine, self.syncer, self.rank, self.group = mine, syncer, rank, group
        self.device = torch.device(device)  # the group's: what its all-to-all takes (a wire message is on the CPU)
        k = mine.count
        self.owned = [i for i in range(syncer.count) if i % k == rank]
        self.same = mine == syncer
        self.plan = [] if self.same else moves(mine, syncer)

    def _exchange(self, pieces_out, pieces_in, numel_in: int) -> torch.Tensor:
        """Send ``pieces_out[d]`` (a list of tensors) to each rank ``d``; receive ``pieces_in[s]`` element counts
        from each rank ``s``, end to end (on ``device``)."""
        k, empty = self.mine.count, torch.empty(0, device=self.device)
        if k == 1:
            return torch.cat(pieces_out[0]).to(self.device) if pieces_out[0] else empty
        send = torch.cat([t.to(self.device) for d in range(k) for t in pieces_out[d]] or [empty])
        recv = torch.empty(numel_in, dtype=send.dtype, device=self.device)
        tdist.all_to_all_single(recv, send, [sum(pieces_in[s]) for s in range(k)],
                                [sum(t.numel() for t in pieces_out[d]) for d in range(k)], group=self.group)
        return recv

    def to_syncer(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """This rank's part (``mine.numel`` elements) → the syncer parts it holds (zero padding). A collective:
        every rank of the learner calls it."""
        if self.same:
            return [flat]
        k, r = self.mine.count, self.rank
        out = [[] for _ in range(k)]
        sizes = [[] for _ in range(k)]
        for p, so, i, _, n in self.plan:
            if p == r:
                out[i % k].append(flat[so:so + n])
            if i % k == r:
                sizes[p].append(n)
        recv = self._exchange(out, sizes, sum(map(sum, sizes)))
        slices = {i: recv.new_zeros(self.syncer.numel) for i in self.owned}
        at = {s: sum(sum(sizes[q]) for q in range(s)) for s in range(k)}
        for p, _, i, do, n in self.plan:
            if i % k == r:
                slices[i][do:do + n].copy_(recv[at[p]:at[p] + n])
                at[p] += n
        return [slices[i] for i in self.owned]

    def from_syncer(self, slices: List[torch.Tensor]) -> torch.Tensor:
        """The syncer parts this rank holds (in ``owned`` order) → this rank's part (``mine.numel`` fp32 elements on
        ``device``, its padding zero; the one part itself when the layouts are one). A collective: every rank of
        the learner calls it."""
        if self.same:
            return slices[0]
        k, r = self.mine.count, self.rank
        held = dict(zip(self.owned, slices))
        out = [[] for _ in range(k)]
        sizes = [[] for _ in range(k)]
        for p, _, i, do, n in self.plan:
            if i % k == r:
                out[p].append(held[i][do:do + n].float())
            if p == r:
                sizes[i % k].append(n)
        recv = self._exchange(out, sizes, sum(map(sum, sizes)))
        flat = torch.zeros(self.mine.numel, dtype=torch.float32, device=self.device)
        at = {s: sum(sum(sizes[q]) for q in range(s)) for s in range(k)}
        for p, so, i, _, n in self.plan:
            if p == r:
                flat[so:so + n].copy_(recv[at[i % k]:at[i % k] + n])
                at[i % k] += n
        return flat


__all__ = ["Parts", "Relayout", "moves", "part_width"]

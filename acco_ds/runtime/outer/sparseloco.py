"""SparseLoCo: DiLoCo's blocking periods with sparse outer communication and error feedback.

At every sync, on each replica r (docs/sparseloco.md has the contract, exact)::

    δ_r = anchor − θ_r;   e_r = β e_r + δ_r                         (fp32, e_r sharded like the masters)
    per chunk (each parameter tensor cut into ``chunk`` elements): keep the ``topk`` entries of largest
    |e_r| (ties: lower index), q_r = their nearest of 2^b levels of the chunk's max (or their values)
    e_r[kept] −= q_r
    anchor −= outer_lr · (Σ_r scatter(q_r)) / R;   every replica restarts at the anchor

Aggregation is an all-gather of each replica's payload (indices at the bits their chunk needs, b-bit codes,
one fp32 scale per chunk; zlib-coded when that is smaller: ``ops/sparse_codec.py``) over the outer group
(the ranks holding the same shard in every replica), then every rank unpacks all R payloads into its part of
the average: no all-reduce, since the indices differ per replica. A chunk straddling two ranks' ZeRO-1 partitions is packed by the rank holding its first element,
which first takes the other ranks' part of the error buffer and afterwards hands back their residual and
averaged update (``chunks.py``). Mixture of experts: an expert group is cut into chunks over its own partition
(its expert-data-parallel ranks inside the replica, its partners for straddling chunks); its payloads travel
over the outer group, the ranks holding the same experts in every replica (the expert group's rails). The
error buffer is rank state, in the masters' layout: checkpointed, resharded by the replica mapping rule,
counted by the memory estimator. The inner optimizer state carries on across syncs, as in DiLoCo; there is
no outer momentum (the error buffer replaces it).
"""

import math
import time
from typing import List, Optional

import torch
import torch.distributed as tdist

from ...ops import load_kernels, sparse_codec
from ...ops.reference import sparse_layout
from . import words
from .base import LocalSGD
from .chunks import ChunkPlan, chunk_plan
from .interface import ReplicaGroups, Shards
from .sparse_overlap import SparseOverlap
from .sparse_state import SparseCheckpoints
from .sparse_tp import WholeTensors, whole_layout
from ..reshard import Layout


def fsdp2_layout(param, k: int) -> list:
    """Per rank ``(start, size)`` of FSDP2's ``Shard(0)`` of ``param`` (one group per parameter on that host)
    over the ``k`` ranks of a replica: ``ceil(rows / k)`` rows each, the last ones shorter or empty."""
    layout = Layout.dim0(param.shape, k)
    return list(zip(layout.starts, layout.sizes))


class SparseLoCo(SparseCheckpoints, SparseOverlap, LocalSGD):
    """The outer loop of mode ``sparseloco`` (see the module docstring; ``overlap`` > 0: ``sparse_overlap``;
    checkpoints: ``sparse_state``). Args: as ``LocalSGD``."""

    schedule_mode = "diloco"  # periods of sync_every inner steps
    dense_outer = False  # its own compression: acco.compression never applies to its outer step

    def __init__(self, acco, shards: Shards, groups: ReplicaGroups):
        self.check_overlap(acco, groups)
        layout = whole_layout(shards, groups.tensor_parallel) if groups.tensor_parallel > 1 else None
        self.overlap = (acco.local_sgd.overlap if acco.local_sgd is not None else 0) or 0
        self.finishing = False  # finalize: the last sync blocks
        super().__init__(acco, shards, groups)
        ls = self.local
        self.chunk, self.topk, self.decay = ls.chunk, ls.topk, ls.error_decay
        self.bits = ls.value_bits or 0  # 0: fp32 values (the wire format's b = 0)
        self.coding = ls.entropy_coding
        self.kernels = load_kernels(acco.kernels, shards.device)
        # Tensor parallelism: chunks of whole tensors, dealt out to the replica's ranks (sparse_tp.py); else
        # each rank packs the chunks that start in its partition (chunks.py)
        self.whole = WholeTensors(layout, shards, groups, self.chunk) if layout is not None else None
        self.peers = [self._partitioned_over(i) for i in range(len(shards.masters))]
        self.plans: List[ChunkPlan] = [] if self.whole is not None else [
            chunk_plan([(p.numel(), off) for p, off in group], shards.partition[i], len(self.peers[i][0]),
                       self.peers[i][2], self.chunk,
                       None if shards.flats is not None else fsdp2_layout(group[0][0], groups.k))
            for i, group in enumerate(shards.params)]
        self.momentum = []  # no outer momentum: the error buffer replaces it
        self.error = [torch.zeros_like(m) for m in shards.masters]
        mine = [self.whole.offsets] if self.whole is not None else [p.offsets for p in self.plans]
        mine = [o for o in mine if o.numel() > 1]
        self.payload = sum(sparse_codec.packed_bytes(o, self.topk, self.bits) for o in mine)
        self.wire_bytes: Optional[int] = None  # what this rank's payloads took on the wire at the last sync
        self.kept = sum(int(sparse_layout(o, self.topk, self.bits)[1][-1]) for o in mine)
        self.owned = sum(int(o[-1]) for o in mine)  # elements in this rank's chunks
        self.boundary_bytes = 0  # bytes this rank sent to its replica's ranks for straddling chunks
        self.residual_norm: Optional[float] = None  # ‖e‖ of this replica after the last sync
        self.state_peak_bytes = 0  # most bytes of fp32 outer state held at once (anchor, error, sync temporaries)

    @property
    def overlapped(self) -> bool:
        return self.overlap > 0  # the gather runs on the outer communication thread

    def _partitioned_over(self, i: int):
        """(global ranks, process group, this rank's index) of the ranks of this replica that partition group
        ``i``: the replica, or for an expert group its expert-data-parallel ranks inside the replica."""
        own = self.shards.gather[i] if self.shards.gather is not None else None
        if own is None:
            return self.groups.replica_ranks, self.groups.replica_main, self.groups.shard
        return tdist.get_process_group_ranks(own[1]), own[1], own[0]

    # ------------------------------------------------------------------ the sync
    @torch.no_grad()
    def _sync(self, sync) -> None:
        if self.overlap and not self.finishing:
            self.start_flight()
        else:
            self._sparse_sync()

    def after_inner_step(self) -> None:
        self.count_flight()  # before the period's end: N < sync_every, so it lands before the next sync
        super().after_inner_step()

    def finalize(self) -> None:
        """A gather in flight lands now; then the blocking sync of the unfinished period. With no inner step
        since the gather's sync, every replica takes the anchor (θ + (x − θ) is x only in exact arithmetic)."""
        if self.flight is not None:
            fresh = self.schedule.inner == 0
            self.land_flight()
            if fresh:
                with torch.no_grad():  # the masters are leaves that require grad, as in _sync
                    for master, x in zip(self.shards.masters, self.anchor):
                        master.copy_(x)
                    self._install(self.shards.masters)
        self.finishing = True
        try:
            super().finalize()
        finally:
            self.finishing = False

    def settle(self) -> None:
        self.collect_flight()  # the gather in flight done and averaged; it lands at its own step

    def join_sync(self) -> bool:
        """A replica that joins takes part in its first sync with weight 0 (``fault_tolerance.JoinsAndHeals``)."""
        return self._sparse_sync(join=True)

    @torch.no_grad()
    def _sparse_sync(self, join: bool = False) -> bool:
        """One sync; returns whether it committed (always, in a fixed fleet). This replica's merge weight is 0
        when it joins, else ``merge_weight()`` (after the quorum: a replica that just healed adds nothing).
        Unless its payload went into a committed average (weight > 0, commit), the replica's error buffers are
        left as before the sync: what it did not send stays its own."""
        start = time.perf_counter()
        self.wire_bytes = 0
        ft = self.fault_tolerance is not None
        if ft:
            self.begin_sync()
        weight = 0.0 if join else self.merge_weight()
        before = [e.clone() for e in self.error] if ft else None
        for i, (x, master, e) in enumerate(zip(self.anchor, self.shards.masters, self.error)):
            e.mul_(self.decay).add_(x - master)
            self.refuse_non_finite(e, i)
        if self.whole is not None:
            average = self._sync_whole(weight)
        else:
            average = [self._sync_group(plan, e, weight, peers)
                       for plan, e, peers in zip(self.plans, self.error, self.peers)]
        self.note_state(average)
        committed = self.transport.commit()
        if ft and (not committed or weight == 0):
            for e, b in zip(self.error, before):
                e.copy_(b)
        if committed:  # (the average is zero when no replica contributed)
            for x, avg in zip(self.anchor, average):
                x.sub_(avg, alpha=self.settings["outer_lr"])
            self._install(self.anchor)
            self.unsent_steps = 0
        self.residual_norm = self.error_norm()
        seconds = time.perf_counter() - start
        self.outer_comm_s += seconds
        self.outer_wait_s += seconds
        return committed

    def note_state(self, held: List[torch.Tensor]) -> None:
        """Measure the outer state held now: the anchor and error shards plus ``held`` (a sync's average; an
        overlapped sync's weights at the sync and average), by the storage each tensor keeps alive."""
        tensors = [*self.anchor, *self.error, *held]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        self.state_peak_bytes = max(self.state_peak_bytes, sum(storages.values()))

    def refuse_non_finite(self, e: torch.Tensor, i: int) -> None:
        if not bool(torch.isfinite(e).all()):
            raise FloatingPointError(f"sparseloco: the pseudo-gradient of parameter group {i} is not finite at "
                                     f"sync {self.syncs + 1} (the inner steps diverged): lower the learning rate "
                                     f"or set gradient_clipping")

    def error_norm(self) -> float:
        """‖e‖ over the parameters this rank's replica holds (replicated tensors once)."""
        segments = self.shards.norm_segments if self.whole is not None else None
        squares = sum(float(e.double().square().sum()) for e in self.error) if segments is None else sum(
            float(e[a:a + n].double().square().sum()) for e, ranges in zip(self.error, segments) for a, n in ranges)
        return math.sqrt(self.groups.reduce(squares, self.shards.device))

    def _sync_group(self, plan: ChunkPlan, e: torch.Tensor, weight: float, peers) -> torch.Tensor:
        """Pack this rank's chunks of one group, gather every replica's payload, return this rank's partition
        of the weighted average (``e`` keeps its residual). ``peers``: ``_partitioned_over``'s answer."""
        P = plan.partition
        tails = self._exchange(plan, [e[:plan.head]] if plan.head else [], [n for _, n in plan.tails], peers)
        ext = torch.cat([e, *tails]) if tails else e
        avg = torch.empty_like(ext) if plan.chunks else torch.zeros_like(ext)
        if plan.chunks:  # sparse_average writes its region whole
            avg[:plan.own_lo].zero_()
            avg[plan.own_hi:].zero_()
            self._pack_and_average(ext[plan.own_lo:plan.own_hi], avg[plan.own_lo:plan.own_hi], plan.offsets, weight)
        if tails:  # ext is a copy: the partition's residual goes back into e
            e.copy_(ext[:P])
        # Hand each sending rank its residual and averaged update; take this rank's head back.
        back, at = [], P
        for _, n in plan.tails:
            back.append(torch.cat([ext[at:at + n], avg[at:at + n]]))
            at += n
        head = self._exchange(plan, back, [2 * plan.head] if plan.head else [], peers, reverse=True)
        avg = avg[:P]
        if head:
            e[:plan.head].copy_(head[0][:plan.head])
            avg[:plan.head].copy_(head[0][plan.head:])
        return avg

    def _sync_whole(self, weight: float) -> List[torch.Tensor]:
        """Tensor parallelism: the whole model's chunks, this rank's share packed (``sparse_tp``)."""
        w = self.whole
        ext = w.assemble(self.error)
        both = ext.new_zeros(2, ext.numel())  # [residual, average], zero outside this rank's chunks
        if w.chunks:
            self._pack_and_average(ext[w.lo:w.hi], both[1, w.lo:w.hi], w.offsets, weight)
            both[0, w.lo:w.hi] = ext[w.lo:w.hi]
        del ext
        return w.spread(both, self.error)

    def _pack_and_average(self, region: torch.Tensor, avg: torch.Tensor, offsets, weight: float) -> None:
        """Pack ``region``'s chunks (it keeps the residual), gather every replica's payload, ``avg`` ← their
        weighted average."""
        payload = self.kernels.sparse_pack(region, offsets, topk=self.topk, value_bits=self.bits)
        gathered = list(self._gather(payload, offsets, weight))  # weight 0 (it just joined): left out
        self.kernels.sparse_average(avg, offsets, [p for p, _ in gathered], [w for _, w in gathered],
                                    topk=self.topk, value_bits=self.bits)

    def _exchange(self, plan: ChunkPlan, sends: List[torch.Tensor], sizes: List[int], peers, reverse: bool = False):
        """Point-to-point inside the replica (``peers``: the group's partitioning ranks): forward, this rank's
        head to its owner and the tails from the ranks it owns chunks of; ``reverse``: the other way. Returns
        the received tensors (``sizes``)."""
        if not sends and not sizes:
            return []
        ranks, group = peers[0], peers[1]
        owner_side = [ranks[t] for t, _ in plan.tails]
        head_side = [ranks[plan.head_owner]] if plan.head else []
        to, frm = (owner_side, head_side) if reverse else (head_side, owner_side)
        received = [self.error[0].new_empty(n) for n in sizes]
        ops = [tdist.P2POp(tdist.isend, t, peer, group) for t, peer in zip(sends, to)]
        ops += [tdist.P2POp(tdist.irecv, t, peer, group) for t, peer in zip(received, frm)]
        for work in tdist.batch_isend_irecv(ops):
            work.wait()
        self.boundary_bytes += sum(t.numel() * t.element_size() for t in sends)
        return received

    def _gather(self, payload, offsets, weight: float):
        """Every replica's ``(indices, values, scales)`` of this shard's chunks with its merge weight, in replica
        order, leaving out those of weight 0 (they add nothing to the average). The payload travels encoded
        (``sparse_codec``); zlib-coded payloads differ in length, so their lengths are gathered first and every
        replica's bytes are padded to the longest (``transport.gather`` moves equal sizes)."""
        wire = sparse_codec.encode(payload, offsets, topk=self.topk, value_bits=self.bits, coding=self.coding)
        self.wire_bytes += wire.numel()
        sizes = None
        if self.coding is not None:
            mine = torch.tensor([wire.numel()], dtype=torch.int64, device=wire.device).view(torch.uint8)
            sizes = [int(b.cpu().clone().view(torch.int64)[0]) for b, _ in self.transport.gather(mine, weight)]
            longest = max(sizes, default=wire.numel())
            wire = torch.cat([wire, wire.new_zeros(longest - wire.numel())])
        for r, (buf, w) in enumerate(self.transport.gather(wire, weight)):
            if w:
                n = sizes[r] if sizes is not None else buf.numel()
                yield sparse_codec.decode(buf[:n], offsets, topk=self.topk, value_bits=self.bits,
                                          device=payload[0].device), w

    # ------------------------------------------------------------------ words and figures
    def banner(self) -> str:
        return words.sparse_banner(self)

    def report(self):
        return words.report(self) + [("sparse outer", words.sparse_words(self.stats()))]

    def stats(self) -> dict:
        s = super().stats()
        s.update(sparse_chunk=self.chunk, sparse_topk=self.topk, sparse_value_bits=self.bits or None,
                 sparse_error_decay=self.decay, sparse_density=self.kept / self.owned if self.owned else 0.0,
                 sparse_payload_bytes=self.payload, sparse_wire_bytes=self.wire_bytes,
                 sparse_entropy_coding=self.coding, sparse_dense_bytes=4 * self.owned,
                 sparse_boundary_bytes=self.boundary_bytes, sparse_residual_norm=self.residual_norm,
                 outer_residual_bytes=sum(e.numel() * e.element_size() for e in self.error),
                 outer_state_peak_bytes=self.state_peak_bytes)
        return s


__all__ = ["SparseLoCo"]
